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
from tpcompile.capture.precision import compute_dtype, compute_twin, float32_masters, full_state
from tpcompile.hybrid.pieces import find_blocks
from tpcompile.passes.mixed_precision import mixed_precision_pass
from tpcompile.passes.recompute import checkpoint_blocks, checkpoint_selective, recompute_mode
from tpcompile.runtime.agreement import agree_program, agree_state
from tpcompile.runtime.fingerprint import graph_lines, plan_lines
from tpcompile.runtime.input_check import InputCheck, check_inputs_mode
from tpcompile.runtime.shape_cache import check_max_shapes, install_reshard, share_tensors
from tpcompile.runtime.startup_check import schedule

__all__ = ["parallelize", "default_device"]

log = logging.getLogger("tpcompile")
ENTRY = "tpcompile.parallelize"


def default_device() -> torch.device:
    """cuda:LOCAL_RANK when the default group runs NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return torch.device("cpu")


def parallelize(model: nn.Module, *, example_inputs: Any = (), example_kwargs: Optional[dict] = None,
                group: Any = None, weights: Optional[Weights] = None,
                device: Union[str, torch.device, None] = None, check: bool = True,
                plan: Optional[dict] = None, sequence_parallel: bool = False,
                dynamic_shapes: Any = None, comm: Any = None, mixed_precision: Optional[str] = None,
                activation_checkpointing: Union[bool, str] = False, check_inputs: str = "first",
                max_shapes: Optional[int] = None) -> GraphModule:
    """Shard `model` over `group` (default: every process) and return this rank's GraphModule.

    Call it on every rank of an initialised process group. A model built under
    `torch.device("meta")` is captured without data; `weights` (a full state dict, a
    .safetensors or .pt file, a list of them, a directory of .safetensors files, or a
    tpcompile.dcp checkpoint directory saved at any world size) then fills this rank's
    tensors, reading only its slices. `check` runs the startup agreement (runtime/agreement.py)
    before any collective of the model: ranks holding other tensors, or that captured other code or
    sharded differently, fail with a TPCompileError naming the first difference instead of computing
    a mixture or hanging; weights whose values differ are replaced by rank 0's (as DDP does), with one
    logged line. `check_inputs` ("first", "always", "never") compares a call's inputs across the group
    (runtime/input_check.py). `comm` is shard()'s: the communication passes on the rank graph.
    `mixed_precision` ("bf16", "fp16" or None): the graph computes in that dtype, the module's
    parameters are float32 masters (their gradients float32, so is the optimizer's state built on
    them), and gradient sums across ranks run in float32 (capture/precision.py,
    passes/mixed_precision.py); with "fp16" scale the loss (tpcompile.runtime.loss_scale.LossScaler).
    `activation_checkpointing`: True or "blocks" recomputes each of the model's repeated blocks in backward,
    "selective" keeps matmul, attention and collective outputs and recomputes the rest (passes/recompute.py).
    `max_shapes`: a call at a shape the rank graph's guards refuse (a dim the model's code fixed) is captured
    and sharded again for it on every rank, agreed like the first and sharing its weights; at most this many
    such captures are kept (default 8, TPCOMPILE_MAX_SHAPES; 0: the guard's error instead), runtime/shape_cache.py.
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
    check_inputs_mode(check_inputs)
    max_shapes = None if max_shapes is None else check_max_shapes(max_shapes)
    compute = compute_dtype(mixed_precision)
    recompute = recompute_mode(activation_checkpointing)
    blocks = find_blocks(model)
    if check:  # before capture: other tensors raise, other values are replaced by rank 0's
        agree_state(_named_tensors(model), group, values=weights is None and not on_meta, entry=ENTRY)
    if compute is not None:  # captured in the compute dtype on meta; the float32 values fill the masters
        weights = full_state(model) if weights is None else weights
        model, on_meta = compute_twin(model, compute), True
    if on_meta:  # meta weights need meta example inputs
        if not example_inputs and not example_kwargs:
            example_inputs, example_kwargs = infer_example_inputs(model, "tpcompile.parallelize")
        example_inputs = _to(example_inputs, torch.device("meta"))
        example_kwargs = _to(example_kwargs, torch.device("meta"))
    sm = shard(model, ws, example_inputs=example_inputs, example_kwargs=example_kwargs,
               dynamic_shapes=dynamic_shapes, plan=plan, group="default" if group is None else group,
               sequence_parallel=sequence_parallel, comm=comm)
    if max_shapes is not None:
        sm.shapes.max_shapes = max_shapes
    gm = sm.rank(rank)
    if compute is not None:
        float32_masters(gm)
        mixed_precision_pass(gm, compute)
    options = [f"world_size={ws}", f"sequence_parallel={bool(sequence_parallel)}", f"comm={sm.comm!r}",
               f"mixed_precision={mixed_precision}", f"activation_checkpointing={recompute}"]
    if check:  # before loading: ranks that disagree learn it without reading any weights
        _agree(sm, gm, group, options, "captured graph")
    _install_input_check(gm, InputCheck(group, mode=check_inputs, names=_input_names(gm), where=ENTRY))
    if recompute == "blocks":
        checkpoint_blocks(gm, blocks)
    elif recompute == "selective":
        checkpoint_selective(gm)
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

    def again(new: Any, r: int) -> None:
        """A capture for another input shape, made like the first: cast, agreed, its weights, checkpointed, moved."""
        g = new.rank(r)
        if compute is not None:
            float32_masters(g)
            mixed_precision_pass(g, compute)
        if check:  # every rank re-shards at the same call: the new graph is agreed before it computes
            _agree(new, g, group, options, "capture for a new input shape")
        share_tensors(g, gm, sm.shapes.names)
        if recompute == "blocks":
            checkpoint_blocks(g, blocks)
        elif recompute == "selective":
            checkpoint_selective(g)
        g.to(target)  # what it holds beyond the shared weights: constants the capture lifted
        retarget(g, capture_device, target)
        g.meta["tpcompile"], g.meta["tpcompile_rank"] = new, r
    install_reshard(gm, sm.shapes, rank, again)
    return gm


def _agree(sm: Any, gm: GraphModule, group: Any, options: list[str], label: str) -> None:
    """The startup agreement's second exchange: the captured graph, the plan and gm's collective schedule."""
    ws = sm.world_size
    fake = [n.meta["val"] for n in sm.captured.graph.nodes if n.op == "placeholder"]
    digest = agree_program(graph_lines(sm.captured), plan_lines(sm.plan, sm.overrides, options),
                           schedule(gm, fake, group_name=f"group of {ws}"), group, entry=ENTRY, graph_label=label)
    log.info("rank %d of %d: %s, plan and collective schedule %s agree on every rank", dist.get_rank(group), ws,
             label, digest)


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of the model by name (tied ones under each name)."""
    return list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))


def _input_names(gm: GraphModule) -> list[str]:
    """The rank graph's flat input names (the model's argument names), in call order."""
    return [n.name for n in gm.graph.nodes if n.op == "placeholder"]


def _install_input_check(gm: GraphModule, check: InputCheck) -> None:
    """Run `check` before the rank module's forward; in mode "first" it removes itself after one call."""
    if check.mode == "never":
        return

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        check(args, kwargs)
        if check.mode == "first":
            handle.remove()  # checked once: later calls run the bare graph
    handle = gm.register_forward_pre_hook(hook, with_kwargs=True)
    gm.meta["tpcompile_input_check"] = check


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
