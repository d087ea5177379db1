"""HybridModel: this rank's part of a model trained with tensor x data x pipeline parallelism."""
from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.fx import GraphModule

from tpcompile.errors import TPCompileError
from tpcompile.hybrid.checkpoint import TensorSpec, dcp_state
from tpcompile.hybrid.grads import LocalParam, TiedGrads, clip_grad_norm, local_tensor
from tpcompile.hybrid.io import InputLayout
from tpcompile.hybrid.pipeline import Pipeline


class HybridModel:
    """This rank's pipeline stages, tensor-parallel and wrapped by FSDP2 or DDP, and their train step.

    `step(*inputs, target=...)` runs forward and backward over all microbatches of this
    data-parallel rank's batch and returns the loss of the whole global batch (the same on every
    rank); gradients accumulate in `.grad` as with `loss.backward()`, so call the optimizer's
    `zero_grad()` between steps. `parameters()` feeds any torch optimizer; `clip_grad_norm_` clips
    by the global norm; `tpcompile.dcp.save(hm, path)` / `tpcompile.dcp.load(hm, path)` checkpoint it.
    """

    def __init__(self, *, mesh: DeviceMesh, stages: dict[int, GraphModule], wrapped: dict[int, nn.Module],
                 specs: dict[str, TensorSpec], pipeline: Pipeline, layout: InputLayout, ties: TiedGrads,
                 data_parallel: str, schedule: str) -> None:
        self.mesh, self.stages, self.wrapped, self.specs = mesh, stages, wrapped, specs
        self.pipeline, self.layout, self.ties = pipeline, layout, ties
        self.data_parallel, self.schedule = data_parallel, schedule
        self.tp_rank, self.tp = mesh["tp"].get_local_rank(), mesh["tp"].size()

    @property
    def stage_indices(self) -> list[int]:
        """The pipeline stages this rank runs."""
        return sorted(self.stages)

    @property
    def num_stages(self) -> int:
        """Pipeline stages in all."""
        return self.pipeline.n_stages

    def local_params(self) -> list[LocalParam]:
        """Every parameter copy this rank holds, with its stage and spec (read after wrapping: FSDP swaps them)."""
        out: list[LocalParam] = []
        for idx in self.stage_indices:
            for name, p in self.stages[idx].named_parameters():
                out.append(LocalParam(idx, p, self.specs[name]))
        return out

    def held_tensors(self) -> Iterator[tuple[torch.Tensor, TensorSpec]]:
        """(tensor, spec) of every parameter and buffer this rank holds, for checkpoints and weights."""
        for idx in self.stage_indices:
            stage = self.stages[idx]
            names = stage.meta["names"]
            for name, t in list(stage.named_parameters()) + list(stage.named_buffers()):
                spec = self.specs.get(names.get(name, name))
                if spec is not None:
                    yield t, spec

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters (its stages' slices and shards), for a torch optimizer."""
        seen: set[int] = set()
        for lp in self.local_params():
            if id(lp.param) not in seen:
                seen.add(id(lp.param))
                yield lp.param

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(the model's name, parameter) of this rank's parameters."""
        seen: set[int] = set()
        for lp in self.local_params():
            if id(lp.param) not in seen:
                seen.add(id(lp.param))
                yield lp.spec.name, lp.param

    def step(self, *inputs: Any, target: Any = None, **kwargs: Any) -> torch.Tensor:
        """Forward and backward of this data-parallel rank's batch, gradients synchronised; the global mean loss."""
        if target is None:
            raise TPCompileError("step() needs target=...: the loss is computed from the model's output and the "
                                 "target on the last pipeline stage")
        tensors = self.layout.first_stage_inputs(inputs, kwargs)
        tensors = [t.to(self.pipeline.device) for t in tensors]
        if isinstance(target, torch.Tensor):
            target = target.to(self.pipeline.device)
        params = self.local_params()
        before = self.ties.snapshot(params)  # gradients accumulate over steps until zero_grad()
        mine = self.pipeline.step(tensors, target)
        self.ties.sync(self.local_params(), before)
        loss = torch.zeros((), dtype=self.layout.output_dtype, device=self.pipeline.device)
        if mine is not None:
            loss.copy_(mine)
        pp = self.mesh["pp"]
        if pp.size() > 1:  # the last stage's rank has the loss: every pipeline rank gets it
            owner = (self.num_stages - 1) % pp.size()
            dist.broadcast(loss, src=dist.get_global_rank(pp.get_group(), owner), group=pp.get_group())
        dp = self.mesh["dp"]
        if dp.size() > 1:  # the global batch's loss: the mean of the data-parallel ranks' losses
            dist.all_reduce(loss, group=dp.get_group())
            loss /= dp.size()
        return loss

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip all gradients by their global norm (over every stage, TP slice and FSDP shard); that norm."""
        return clip_grad_norm(self.local_params(), self.ties, self.mesh, float(max_norm), float(norm_type),
                              sharded_dp=self.data_parallel == "fsdp")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every local gradient."""
        for p in self.parameters():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def dcp_state(self) -> dict[str, Any]:
        """This rank's tensors as chunks of the full tensors, keyed by the model's names (tpcompile.dcp)."""
        return dcp_state(self.held_tensors(), self.tp_rank, self.tp)

    def parameter_bytes(self) -> int:
        """Bytes of parameter storage this rank holds now (its shards between steps)."""
        seen: dict[int, torch.Tensor] = {}
        for p in self.parameters():
            t = local_tensor(p)
            seen[id(t)] = t
        return sum(t.numel() * t.element_size() for t in seen.values())

    def __repr__(self) -> str:
        dims = ", ".join(f"{d}={self.mesh[d].size()}" for d in ("dp", "tp", "pp"))
        return (f"HybridModel({dims}, stages {self.stage_indices} of {self.num_stages}, "
                f"{self.data_parallel}, {self.schedule})")

