"""The five ways to run a workload on one rank: one process, hand-written, DTensor, _tp_transform, tpcompile."""

from __future__ import annotations

import copy
import time
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import tpcompile
from tpcompile.models import GPT
from tpcompile.models.gpt import CausalSelfAttention
from tpcompile.models.mlp import MLPStack

from bench.device import rank_device
from bench.handwritten_mlp import TPMLPStack
from bench.handwritten_tp import TPGPT
from bench.workloads import Workload

__all__ = ["CONTENDERS", "Contender", "build_contender", "parameter_bytes"]

CONTENDERS = ("single", "hand-written", "dtensor", "tp_transform", "tpcompile")


@dataclass
class Contender:
    """A rank's runnable module and its trainable tensors, or why it could not be built."""

    name: str
    module: Optional[Callable] = None
    params: list = field(default_factory=list)
    error: Optional[str] = None
    setup_s: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)


def parameter_bytes(params: list) -> int:
    """Bytes of the distinct local parameter storages (a DTensor counts its local shard)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for p in params:
        t = p.to_local() if isinstance(p, DTensor) else p
        key = (t.data_ptr(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def _handwritten(wl: Workload, model: nn.Module, rank: int, ws: int) -> nn.Module:
    """The Megatron-style module for this workload's model, on the model's device."""
    device = next(model.parameters()).device
    # Its layer norms are built afresh (on the CPU); the slices already sit on the model's device.
    if isinstance(model, MLPStack):
        return TPMLPStack(model, rank, ws).to(device)
    if isinstance(model, GPT):
        return TPGPT(model, rank, ws).to(device)
    raise TypeError(f"no hand-written split for {type(model).__name__}")


def _dtensor_style(kind: str) -> Any:
    """The ParallelStyle for one plan entry."""
    return {"colwise": lambda: ColwiseParallel(),
            "colwise_dtensor": lambda: ColwiseParallel(),
            "colwise_gather": lambda: ColwiseParallel(output_layouts=Replicate()),
            "rowwise": lambda: RowwiseParallel(),
            "vocab": lambda: RowwiseParallel(input_layouts=Replicate())}[kind]()


def _local_heads_forward(self: CausalSelfAttention, x: torch.Tensor) -> torch.Tensor:
    """The bundled attention with the head count read from the local q width (separate q/k/v, sdpa).

    DTensor's plan hands each rank local q/k/v slices; the model's own view(B, T, n_head, C // n_head)
    names global sizes, and DTensor has no CPU SDPA sharding rule to keep them global, so the model
    code must be written for local heads, as TP recipes built on parallelize_module write it.
    """
    B, T, C = x.size()
    hd = C // self.n_head
    q, k, v = (p(x).view(B, T, -1, hd).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


def _dtensor(wl: Workload, model: nn.Module, ws: int) -> nn.Module:
    """parallelize_module with the workload's column / row / vocabulary plan."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(rank_device().type, (ws,))
    plan = {path: _dtensor_style(kind) for path, kind in wl.plan.items()}
    module = parallelize_module(copy.deepcopy(model), mesh, plan)
    for m in module.modules():
        if isinstance(m, CausalSelfAttention):
            m.forward = types.MethodType(_local_heads_forward, m)
    return module


def _tp_transform(wl: Workload, model: nn.Module, inputs: tuple, rank: int, ws: int) -> nn.Module:
    """torch's experimental export-based transform with the Linear entries of the plan."""
    from torch.distributed.tensor.experimental._tp_transform import tensor_parallel_transformation
    # It takes the style classes and only handles Linear layers; embeddings stay replicated.
    styles = {path: ColwiseParallel if kind.startswith("colwise") else RowwiseParallel
              for path, kind in wl.plan.items() if kind != "vocab"}
    ep = torch.export.export(copy.deepcopy(model), inputs)
    return tensor_parallel_transformation(ep, rank, ws, rank_device().type, styles).module()


def _tpcompile(model: nn.Module, inputs: tuple, rank: int, ws: int, info: dict) -> nn.Module:
    """tpcompile.shard and this rank's graph."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(copy.deepcopy(model), ws, example_inputs=inputs)
        start = time.perf_counter()
        gm = sm.rank(rank)
    info.update(sm.timings, rewrite_s=time.perf_counter() - start,
                static_collectives=[op for op, _ in sm.collectives()])
    return gm


def build_contender(name: str, wl: Workload, model: nn.Module, inputs: tuple, rank: int, ws: int) -> Contender:
    """Contender `name` on this rank; a failure is kept as its message (every rank fails alike)."""
    c = Contender(name)
    start = time.perf_counter()
    try:
        if name == "single":
            c.module = copy.deepcopy(model)
        elif name == "hand-written":
            c.module = _handwritten(wl, model, rank, ws)
        elif name == "dtensor":
            c.module = _dtensor(wl, model, ws)
        elif name == "tp_transform":
            c.module = _tp_transform(wl, model, inputs, rank, ws)
        elif name == "tpcompile":
            c.module = _tpcompile(model, inputs, rank, ws, c.info)
        else:
            raise ValueError(f"unknown contender {name!r}; choose from {CONTENDERS}")
        c.params = [p for p in c.module.parameters()]
    except Exception as e:  # noqa: BLE001  a contender that cannot handle a model is a result
        c.module, c.error = None, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    c.setup_s = time.perf_counter() - start
    if dist.is_initialized():
        # A contender runs only where every rank built it, so no rank waits on a missing peer.
        ok = torch.tensor([0 if c.module is None else 1], device=rank_device())
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if not int(ok) and c.error is None:
            c.module, c.error = None, "failed on another rank"
    return c
