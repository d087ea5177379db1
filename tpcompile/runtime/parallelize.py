"""parallelize(): this process's rank module, sharded and loaded inside a running process group."""
from __future__ import annotations

import logging
import os
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.fx import GraphModule

from tpcompile.api import shard
from tpcompile.capture import infer_example_inputs
from tpcompile.checkpoint.weights import Weights, allocate, load_rank_weights, retarget
from tpcompile.errors import TPCompileError
from tpcompile.runtime.startup_check import check_schedules, schedule

__all__ = ["parallelize", "default_device"]

log = logging.getLogger("tpcompile")


def default_device() -> torch.device:
    """cuda:LOCAL_RANK when the default group runs NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return torch.device("cpu")


def parallelize(model: nn.Module, *, example_inputs: Any = (), example_kwargs: Optional[dict] = None,
                group: Any = None, weights: Optional[Weights] = None,
                device: Union[str, torch.device, None] = None, check: bool = True,
                plan: Optional[dict] = None, sequence_parallel: bool = False,
                dynamic_shapes: Any = None) -> GraphModule:
    """Shard `model` over `group` (default: every process) and return this rank's GraphModule.

    Call it on every rank of an initialised process group. A model built under
    `torch.device("meta")` is captured without data; `weights` (a full state dict, a
    .safetensors or .pt file, a list of them, a directory of .safetensors files, or a
    tpcompile.dcp checkpoint directory saved at any world size) then fills this rank's
    tensors, reading only its slices. `check` exchanges the ranks' collective schedules first, so
    ranks that sharded differently fail with a TPCompileError instead of hanging.
    `gm.meta["tpcompile"]` and `gm.meta["tpcompile_rank"]` keep the ShardedModel and the
    rank, which tpcompile.dcp.save/load read.
    """
    if not dist.is_initialized():
        raise TPCompileError("parallelize needs an initialised process group: start under torchrun and "
                             "call tpcompile.runtime.init_from_env(), or use tpcompile.shard")
    ws, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise TPCompileError(f"this process (global rank {dist.get_rank()}) is not in the group it was given")
    capture_device = _device_of(model)
    on_meta = capture_device.type == "meta"
    if on_meta and weights is None:
        raise TPCompileError("the model is on the meta device, so parallelize needs weights= (a state "
                             "dict, .safetensors files, or a directory of them or of a DCP checkpoint)")
    if on_meta:  # meta weights need meta example inputs
        if not example_inputs and not example_kwargs:
            example_inputs, example_kwargs = infer_example_inputs(model)
        example_inputs = _to(example_inputs, capture_device)
        example_kwargs = _to(example_kwargs, capture_device)
    sm = shard(model, ws, example_inputs=example_inputs, example_kwargs=example_kwargs,
               dynamic_shapes=dynamic_shapes, plan=plan, group="default" if group is None else group,
               sequence_parallel=sequence_parallel)
    gm = sm.rank(rank)
    if check:  # before loading: ranks that disagree learn it without reading any weights
        fake = [n.meta["val"] for n in sm.captured.graph.nodes if n.op == "placeholder"]
        digest = check_schedules(schedule(gm, fake, group_name=f"group of {ws}"), group)
        log.info("rank %d of %d: collective schedule %s agrees on every rank", rank, ws, digest)
    target = torch.device(device) if device is not None else default_device()
    gm.meta["tpcompile"], gm.meta["tpcompile_rank"] = sm, rank
    if _is_dcp(weights):  # a sharded checkpoint saved at any world size
        from tpcompile.checkpoint.dcp import load  # torch.distributed.checkpoint only when it is used
        load(allocate(gm, device=target), weights, group=group)
    elif weights is not None:
        load_rank_weights(gm, sm, rank, weights, device=target)
    elif target != capture_device:
        gm.to(target)
    if not on_meta:  # (the loaders retarget what a meta capture baked in)
        retarget(gm, capture_device, target)
    return gm


def _is_dcp(weights: Any) -> bool:
    """True for a directory holding a torch.distributed.checkpoint (its .metadata file)."""
    return isinstance(weights, (str, os.PathLike)) and os.path.isfile(os.path.join(weights, ".metadata"))


def _device_of(model: nn.Module) -> torch.device:
    """The device of the model's first parameter or buffer (the CPU for a model without any)."""
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return torch.device("cpu")


def _to(value: Any, device: torch.device) -> Any:
    """value with every tensor moved to device (tuples, lists and dicts looked into)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value
