"""parallelize_train(): a model trained with tensor x data x pipeline parallelism on one DeviceMesh.

The order of application, on every rank:

    capture   torch.export of the whole model (tpcompile.capture)
    split     pieces at the repeated blocks (pieces.py), grouped into balanced stages (partition.py)
    TP        each piece sharded by tpcompile over mesh["tp"] (its group runs every collective)
    stages    this rank's stages assembled, each block a called submodule owning its parameters
    FSDP/DDP  fully_shard per block and per stage over mesh["dp"], or DDP per stage
    weights   loaded into the local slices and shards (a state dict, safetensors, a DCP checkpoint)
    pipeline  torch.distributed.pipelining stages and schedule over mesh["pp"] (pipeline.py)

The optimizer comes last, from HybridModel.parameters().
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tpcompile.api import shard_captured
from tpcompile.capture import Captured, capture, infer_example_inputs
from tpcompile.checkpoint.weights import retarget
from tpcompile.errors import TPCompileError
from tpcompile.hybrid.io import InputLayout, graph_io
from tpcompile.hybrid.mesh import MESH_DIMS, mesh_device
from tpcompile.hybrid.partition import group_pieces, stage_io
from tpcompile.hybrid.pieces import Piece, find_blocks, split_pieces
from tpcompile.hybrid.stage import blocks_of, build_stage

if TYPE_CHECKING:
    from tpcompile.hybrid.checkpoint import TensorSpec
    from tpcompile.hybrid.model import HybridModel

DATA_PARALLEL = ("fsdp", "ddp")


def _check(mesh: Any, loss_fn: Any, microbatches: Any, data_parallel: Any) -> None:
    """The arguments' kinds, or a TPCompileError saying what to pass."""
    if not isinstance(mesh, DeviceMesh) or tuple(mesh.mesh_dim_names or ()) != MESH_DIMS:
        raise TPCompileError(f"parallelize_train needs the DeviceMesh of tpcompile.init_mesh (dims {MESH_DIMS}), "
                             f"got {mesh!r}")
    if not callable(loss_fn):
        raise TPCompileError("parallelize_train needs loss_fn(output, target) -> scalar loss tensor")
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise TPCompileError(f"microbatches must be an int >= 1, got {microbatches!r}")
    if data_parallel not in DATA_PARALLEL:
        raise TPCompileError(f"data_parallel must be 'fsdp' or 'ddp', got {data_parallel!r}")


def _device_of(model: nn.Module) -> torch.device:
    """The device of the model's first tensor (the CPU for a model without any)."""
    return next((t.device for t in list(model.parameters()) + list(model.buffers())), torch.device("cpu"))


def _to(value: Any, device: torch.device) -> Any:
    """value with every tensor moved to device."""
    return torch.utils._pytree.tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, value)


def _shard_pieces(pieces: list[Piece], cap: Captured, state_names: set[str], tp: int, group: Any, plan: Any,
                  sequence_parallel: bool) -> tuple[list[Any], dict[str, TensorSpec]]:
    """tpcompile's passes on every piece over the TP group; the specs of every tensor, ties checked."""
    from tpcompile.hybrid.checkpoint import TensorSpec
    aliases = _aliases(cap.gm)
    sharded, specs = [], {}
    for piece in pieces:
        sm = shard_captured(Captured(piece.gm, f"{cap.model_name}:{piece.name}", (), {}, cap.module_paths),
                            tp, plan=plan, group=group, sequence_parallel=sequence_parallel)
        sharded.append(sm)
        for name, t in sm._ctx.tensors.items():
            spec = TensorSpec(name, tuple(a for a in aliases.get(name, [name]) if a in state_names),
                              tuple(t.shape), sm._ctx.slice_for(name))
            old = specs.setdefault(name, spec)
            if old.slice != spec.slice:
                raise TPCompileError(
                    f"{name} is used in two pieces ({piece.name} and an earlier one) that tensor parallelism "
                    f"splits differently ({old.slice} vs {spec.slice}); replicate one use, e.g. "
                    f"plan={{'<module using it>': 'replicate'}}")
    return sharded, specs


def _wrap(stage: nn.Module, mesh: DeviceMesh, data_parallel: str, pp: int) -> nn.Module:
    """The stage under FSDP2 (each block a unit, the stage the root unit) or DDP, over mesh["dp"]."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel
    if data_parallel == "ddp":
        return DistributedDataParallel(stage, process_group=mesh["dp"].get_group())
    # with pp > 1 each microbatch would gather a block again in backward: keep it until the step ends
    reshard = pp == 1
    for block in blocks_of(stage):
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=reshard)
    fully_shard(stage, mesh=mesh["dp"], reshard_after_forward=reshard)
    return stage


def _materialise_and_wrap(stage: nn.Module, mesh: DeviceMesh, data_parallel: str, pp: int,
                          device: torch.device, on_meta: bool) -> nn.Module:
    """The stage on `device`, wrapped; a meta stage gets storage for its FSDP shards only (DDP: all of it)."""
    if not on_meta:
        return _wrap(stage.to(device), mesh, data_parallel, pp)
    if data_parallel == "fsdp":  # shard on meta first, then allocate just this rank's shards
        wrapped = _wrap(stage, mesh, data_parallel, pp)
        stage.to_empty(device=device)
    else:  # DDP broadcasts real tensors when it wraps
        wrapped = _wrap(stage.to_empty(device=device), mesh, data_parallel, pp)
    with torch.no_grad():
        for t in list(stage.parameters()) + list(stage.buffers()):
            t.zero_()  # vocabulary padding must be zeros; everything else is loaded afterwards
    return wrapped


def parallelize_train(model: nn.Module, mesh: DeviceMesh, *, loss_fn: Callable[[Any, Any], torch.Tensor],
                      example_inputs: Any = (), example_kwargs: Optional[dict] = None, microbatches: int = 1,
                      schedule: str = "1F1B", data_parallel: str = "fsdp", weights: Any = None,
                      sequence_parallel: bool = False, plan: Any = None,
                      activation_checkpointing: bool = False) -> HybridModel:
    """This rank's HybridModel of `model` on `mesh` (tpcompile.init_mesh): see the module docstring.

    Call on every rank with the same model, arguments and seed. `loss_fn(output, target)` gets the
    model's own output (a tensor, tuple or ModelOutput) for one microbatch and returns its mean loss.
    A model built on the meta device needs `weights` (a full state dict, .safetensors/.pt files or a
    directory of them, or a tpcompile.dcp checkpoint directory saved at any layout).
    """
    # the runtime's torch packages (pipelining, FSDP, DTensor, DCP) take seconds to import: only when used
    from tpcompile.hybrid.grads import TiedGrads
    from tpcompile.hybrid.model import HybridModel
    from tpcompile.hybrid.pipeline import Pipeline, ports, schedule_class, stages_per_rank
    _check(mesh, loss_fn, microbatches, data_parallel)
    pp, tp = mesh["pp"].size(), mesh["tp"].size()
    cls = schedule_class(schedule)
    n_stages = pp * stages_per_rank(cls, pp)
    capture_device, device = _device_of(model), mesh_device()
    on_meta = capture_device.type == "meta"
    if on_meta and weights is None:
        raise TPCompileError("the model is on the meta device, so parallelize_train needs weights= (a state dict, "
                             ".safetensors files, or a directory of them or of a tpcompile.dcp checkpoint)")
    if on_meta and not example_inputs and not example_kwargs:
        example_inputs, example_kwargs = infer_example_inputs(model)
    if on_meta:
        example_inputs, example_kwargs = _to(example_inputs, capture_device), _to(example_kwargs, capture_device)
    cap = capture(model, example_inputs, example_kwargs)
    if activation_checkpointing:
        _check_no_dropout(cap.gm)
    layout = InputLayout(model, cap.gm, cap.example_args, cap.example_kwargs)
    pieces = split_pieces(cap.gm, find_blocks(model))
    stages = group_pieces(pieces, n_stages)
    io = stage_io(stages, *graph_io(cap.gm))
    sharded, specs = _shard_pieces(pieces, cap, set(model.state_dict(keep_vars=True)), tp,
                                    mesh["tp"].get_group(), plan, sequence_parallel)
    by_piece = {id(p): sm for p, sm in zip(pieces, sharded)}
    holders: dict[str, list[int]] = {}
    for s, group in enumerate(stages):
        for p in group:
            for name, _ in p.gm.named_parameters():
                if s not in holders.setdefault(name, []):
                    holders[name].append(s)
    tp_rank = mesh["tp"].get_local_rank()
    mine = [mesh["pp"].get_local_rank() + k * pp for k in range(n_stages // pp)]
    built, wrapped = {}, {}
    for idx in mine:
        ranked = [by_piece[id(p)].rank(tp_rank) for p in stages[idx]]
        stage = build_stage(idx, stages[idx], ranked, *io[idx], activation_checkpointing=activation_checkpointing)
        for gm in [stage, *blocks_of(stage)]:
            retarget(gm, capture_device, device)
        built[idx] = stage
        wrapped[idx] = _materialise_and_wrap(stage, mesh, data_parallel, pp, device, on_meta)
    ties = TiedGrads(holders, mesh)
    pipeline = Pipeline([wrapped[i] for i in mine], mine, n_stages, [(ports(i), ports(o)) for i, o in io],
                        mesh["pp"].get_group(), device, cls, microbatches,
                        lambda out, target: loss_fn(layout.model_output(out), target))
    hm = HybridModel(mesh=mesh, stages=built, wrapped=wrapped, specs=specs, pipeline=pipeline, layout=layout,
                     ties=ties, data_parallel=data_parallel, schedule=cls.__name__.removeprefix("Schedule"))
    if weights is not None:
        _load(hm, weights, on_meta)
    return hm


def _check_no_dropout(gm: nn.Module) -> None:
    """Activation checkpointing recomputes forward in backward; a live dropout would draw other masks there."""
    aten = torch.ops.aten
    for node in gm.graph.nodes:
        p = None
        if node.target in (aten.dropout.default, aten.native_dropout.default):
            training = node.args[2] if len(node.args) > 2 else True
            p = node.args[1] if training else None
        elif node.target is aten.scaled_dot_product_attention.default:
            p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
        if p:
            raise TPCompileError(f"activation_checkpointing with dropout: {node.format_node()} (p={p}) would draw "
                                 f"different masks when backward recomputes it; set the model's dropout to 0 or "
                                 f"call model.eval(), or pass activation_checkpointing=False")


def _aliases(gm: nn.Module) -> dict[str, list[str]]:
    """Every tensor's first name -> all its names (tied weights have several)."""
    by_id: dict[int, list[str]] = {}
    named = list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False))
    for name, t in named:
        by_id.setdefault(id(t), []).append(name)
    return {names[0]: names for names in by_id.values()}


def _load(hm: HybridModel, weights: Any, on_meta: bool) -> None:
    """Fill the local slices and shards from full weights or a DCP checkpoint saved at any layout."""
    if isinstance(weights, (str, os.PathLike)) and os.path.isfile(os.path.join(weights, ".metadata")):
        from tpcompile.checkpoint.dcp import load
        load(hm, weights)  # type: ignore[arg-type]
    else:
        from tpcompile.hybrid.checkpoint import load_weights
        load_weights(hm.held_tensors(), weights, hm.tp_rank, hm.tp, on_meta=on_meta)
