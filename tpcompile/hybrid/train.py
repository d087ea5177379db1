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

from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tpcompile.api import shard_captured
from tpcompile.capture import Captured, capture, infer_example_inputs
from tpcompile.capture.precision import compute_dtype, compute_twin, float32_masters, full_state
from tpcompile.passes.mixed_precision import mixed_precision_pass
from tpcompile.passes.recompute import checkpoint_selective, live_dropout, recompute_mode
from tpcompile.checkpoint.weights import retarget
from tpcompile.errors import TPCompileError
from tpcompile.hybrid.io import InputLayout, graph_io
from tpcompile.hybrid.mesh import MESH_DIMS, mesh_device
from tpcompile.hybrid.partition import group_pieces, stage_io
from tpcompile.hybrid.pieces import Piece, find_blocks, split_pieces
from tpcompile.hybrid.stage import blocks_of, build_stage
from tpcompile.runtime.agreement import agree_program, agree_state
from tpcompile.runtime.fingerprint import graph_lines, plan_lines
from tpcompile.runtime.input_check import InputCheck, check_inputs_mode
from tpcompile.runtime.loss_scale import LossScaler

if TYPE_CHECKING:
    from tpcompile.hybrid.checkpoint import TensorSpec
    from tpcompile.hybrid.model import HybridModel

DATA_PARALLEL = ("fsdp", "ddp")
ENTRY = "tpcompile.parallelize_train"


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


def _check_offload(cpu_offload: bool, data_parallel: str) -> None:
    """CPU offload needs FSDP and a GPU to offload from, or a TPCompileError saying so."""
    if not cpu_offload:
        return
    if data_parallel != "fsdp":
        raise TPCompileError("cpu_offload=True is FSDP2's CPUOffloadPolicy: pass data_parallel='fsdp' (DDP keeps every "
                             "parameter on the device)")
    if mesh_device().type != "cuda":
        raise TPCompileError(f"cpu_offload=True moves FSDP's parameter shards, gradients and optimizer state from GPU "
                             f"memory to the CPU, but this process computes on {mesh_device()} (no CUDA device under "
                             f"NCCL): everything is in CPU memory already; drop cpu_offload=True")


def _device_of(model: nn.Module) -> torch.device:
    """The device of the model's first tensor (the CPU for a model without any)."""
    return next((t.device for t in list(model.parameters()) + list(model.buffers())), torch.device("cpu"))


def _to(value: Any, device: torch.device) -> Any:
    """value with every tensor moved to device."""
    return torch.utils._pytree.tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, value)


def _shard_pieces(pieces: list[Piece], cap: Captured, state_names: set[str], tp: int, group: Any, plan: Any,
                  sequence_parallel: bool, comm: Any = None) -> tuple[list[Any], dict[str, TensorSpec]]:
    """tpcompile's passes on every piece over the TP group; the specs of every tensor, ties checked."""
    from tpcompile.hybrid.checkpoint import TensorSpec
    aliases = _aliases(cap.gm)
    sharded, specs = [], {}
    for piece in pieces:
        sm = shard_captured(Captured(piece.gm, f"{cap.model_name}:{piece.name}", (), {}, cap.module_paths),
                            tp, plan=plan, group=group, sequence_parallel=sequence_parallel, comm=comm)
        sharded.append(sm)
        for name in sm.state_names():
            spec = TensorSpec(name, tuple(a for a in aliases.get(name, [name]) if a in state_names),
                              sm.full_shape(name), sm.slice_for(name))
            old = specs.setdefault(name, spec)
            if old.slice != spec.slice:
                raise TPCompileError(
                    f"{name} is used in two pieces ({piece.name} and an earlier one) that tensor parallelism "
                    f"splits differently ({old.slice} vs {spec.slice}); replicate one use, e.g. "
                    f"plan={{'<module using it>': 'replicate'}}")
    return sharded, specs


def _wrap(stage: nn.Module, mesh: DeviceMesh, data_parallel: str, pp: int, compute: Optional[torch.dtype],
          cpu_offload: bool = False) -> nn.Module:
    """The stage under FSDP2 (each block a unit, the stage the root unit) or DDP, over mesh["dp"]."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel
    if data_parallel == "ddp":  # (mixed precision: float32 parameters cast in the graph, float32 gradients summed)
        return DistributedDataParallel(stage, process_group=mesh["dp"].get_group())
    # with pp > 1 each microbatch would gather a block again in backward: keep it until the step ends
    reshard = pp == 1
    policy = MixedPrecisionPolicy() if compute is None else MixedPrecisionPolicy(param_dtype=compute,
                                                                                  reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    for block in blocks_of(stage):
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=reshard, mp_policy=policy, offload_policy=offload)
    fully_shard(stage, mesh=mesh["dp"], reshard_after_forward=reshard, mp_policy=policy, offload_policy=offload)
    return stage


def _float32(out: Any, compute: Optional[torch.dtype]) -> Any:
    """The last stage's output with compute-dtype tensors in float32, so the loss is computed in float32."""
    if compute is None:
        return out
    return torch.utils._pytree.tree_map(lambda v: v.float() if isinstance(v, torch.Tensor) and v.dtype == compute
                                        else v, out)


def _materialise_and_wrap(stage: nn.Module, mesh: DeviceMesh, data_parallel: str, pp: int,
                          device: torch.device, on_meta: bool, compute: Optional[torch.dtype] = None,
                          cpu_offload: bool = False) -> nn.Module:
    """The stage on `device`, wrapped; a meta stage gets storage for its FSDP shards only (DDP: all of it)."""
    if not on_meta:
        return _wrap(stage.to(device), mesh, data_parallel, pp, compute, cpu_offload)
    from tpcompile.hybrid.checkpoint import real_buffers, restore_buffers
    kept = real_buffers(stage)  # buffers built on a real device keep their values (no file holds a non-persistent one)
    if data_parallel == "fsdp":  # shard on meta first, then allocate just this rank's shards
        wrapped = _wrap(stage, mesh, data_parallel, pp, compute, cpu_offload)
        stage.to_empty(device=device)
    else:  # DDP broadcasts real tensors when it wraps
        wrapped = _wrap(stage.to_empty(device=device), mesh, data_parallel, pp, compute, cpu_offload)
    with torch.no_grad():
        for t in list(stage.parameters()) + list(stage.buffers()):
            t.zero_()  # vocabulary padding must be zeros; everything else is loaded afterwards
    restore_buffers(stage, kept)
    return wrapped


def parallelize_train(model: nn.Module, mesh: DeviceMesh, *, loss_fn: Callable[[Any, Any], torch.Tensor],
                      example_inputs: Any = (), example_kwargs: Optional[dict] = None, microbatches: int = 1,
                      schedule: str = "1F1B", data_parallel: str = "fsdp", weights: Any = None,
                      sequence_parallel: bool = False, plan: Any = None,
                      activation_checkpointing: Union[bool, str] = False,
                      comm: Any = None, mixed_precision: Optional[str] = None, cpu_offload: bool = False,
                      check: bool = True, check_inputs: str = "first") -> HybridModel:
    """This rank's HybridModel of `model` on `mesh` (tpcompile.init_mesh): see the module docstring.

    Call on every rank with the same model and arguments. `loss_fn(output, target)` gets the
    model's own output (a tensor, tuple or ModelOutput) for one microbatch and returns its mean loss.
    A model built on the meta device needs `weights` (a full state dict, .safetensors/.pt files or a
    directory of them, or a tpcompile.dcp checkpoint directory saved at any layout). `check` runs the
    startup agreement over every rank (runtime/agreement.py): other tensors, code or plans raise, other
    weight values are replaced by rank 0's; `check_inputs` compares step()'s batch and target across each
    tensor-parallel group ("first" step, "always", "never"). `comm` is shard()'s, on every piece.
    `mixed_precision` ("bf16", "fp16", None): compute in that dtype with float32 master weights, optimizer
    state and gradient reductions (FSDP2's MixedPrecisionPolicy(param_dtype, reduce_dtype=float32); under
    DDP the float32 parameters are cast in the graph and DDP sums float32 gradients); "fp16" scales the loss
    with a LossScaler whose overflow check is agreed by every rank (docs/hybrid.md). `activation_checkpointing`:
    True or "blocks" recomputes every block in backward, "selective" keeps each block's matmul and collective
    outputs and recomputes the rest. `cpu_offload` keeps FSDP's parameter shards, gradients and optimizer state in
    CPU memory between uses (FSDP2's CPUOffloadPolicy; CUDA only).
    """
    # the runtime's torch packages (pipelining, FSDP, DTensor, DCP) take seconds to import: only when used
    from tpcompile.hybrid.grads import TiedGrads
    from tpcompile.hybrid.model import HybridModel
    from tpcompile.hybrid.pipeline import Pipeline, ports, schedule_class, stages_per_rank
    _check(mesh, loss_fn, microbatches, data_parallel)
    _check_offload(cpu_offload, data_parallel)
    pp, tp = mesh["pp"].size(), mesh["tp"].size()
    cls = schedule_class(schedule)
    n_stages = pp * stages_per_rank(cls, pp)
    capture_device, device = _device_of(model), mesh_device()
    on_meta = capture_device.type == "meta"
    if on_meta and weights is None:
        raise TPCompileError("the model is on the meta device, so parallelize_train needs weights= (a state dict, "
                             ".safetensors files, or a directory of them or of a tpcompile.dcp checkpoint)")
    check_inputs_mode(check_inputs)
    compute = compute_dtype(mixed_precision)
    if check:  # before capture: other tensors raise, other values are replaced by rank 0's
        named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
        agree_state(named, None, values=weights is None and not on_meta, entry=ENTRY)
    if compute is not None:  # captured in the compute dtype on meta; the float32 values fill the masters
        weights = full_state(model) if weights is None else weights
        model, on_meta, capture_device = compute_twin(model, compute), True, torch.device("meta")
    if on_meta and not example_inputs and not example_kwargs:
        example_inputs, example_kwargs = infer_example_inputs(model, "tpcompile.parallelize_train")
    if on_meta:
        example_inputs, example_kwargs = _to(example_inputs, capture_device), _to(example_kwargs, capture_device)
    cap = capture(model, example_inputs, example_kwargs)
    recompute = recompute_mode(activation_checkpointing)
    if recompute == "blocks":
        _check_no_dropout(cap.gm)
    layout = InputLayout(model, cap.gm, cap.example_args, cap.example_kwargs)
    guards = tuple(m for m in (getattr(cap.gm, "_tpcompile_input_guard", None), getattr(cap.gm, "_guards_fn", None))
                   if isinstance(m, nn.Module))
    graph = graph_lines(cap.gm) if check else []  # (before the split takes the graph apart)
    pieces = split_pieces(cap.gm, find_blocks(model))
    stages = group_pieces(pieces, n_stages)
    io = stage_io(stages, *graph_io(cap.gm))
    sharded, specs = _shard_pieces(pieces, cap, set(model.state_dict(keep_vars=True)), tp,
                                    mesh["tp"].get_group(), plan, sequence_parallel, comm)
    if check:  # every rank captured the same graph and sharded every piece alike, before any collective of it
        options = [f"mesh={tuple(mesh.mesh.shape)}", f"schedule={cls.__name__}", f"microbatches={microbatches}",
                   f"data_parallel={data_parallel}", f"sequence_parallel={bool(sequence_parallel)}",
                   f"activation_checkpointing={recompute}", f"comm={sharded[0].comm!r}",
                   f"mixed_precision={mixed_precision}"]
        lines = [line for p, sm in zip(pieces, sharded) for line in plan_lines(sm.plan, sm.overrides,
                                                                                [f"piece {p.name}"])]
        agree_program(graph, lines + options, None, None, entry=ENTRY)
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
        if compute is not None:  # before the stage copies (and checkpointing wraps) the pieces' graphs
            for gm in ranked:
                float32_masters(gm)
                mixed_precision_pass(gm, compute)
        stage = build_stage(idx, stages[idx], ranked, *io[idx], activation_checkpointing=recompute == "blocks")
        if recompute == "selective":  # each block keeps its matmul outputs, recomputes its pointwise ops
            for block in blocks_of(stage):
                checkpoint_selective(block)
        for gm in [stage, *blocks_of(stage)]:
            retarget(gm, capture_device, device)
        built[idx] = stage
        wrapped[idx] = _materialise_and_wrap(stage, mesh, data_parallel, pp, device, on_meta, compute, cpu_offload)
    ties = TiedGrads(holders, mesh)
    pipeline = Pipeline([wrapped[i] for i in mine], mine, n_stages, [(ports(i), ports(o)) for i, o in io],
                        mesh["pp"].get_group(), device, cls, microbatches,
                        lambda out, target: loss_fn(layout.model_output(_float32(out, compute)), target))
    names = [layout.leaf_names[i] for i in layout.tensor_positions] + ["target"]
    hm = HybridModel(mesh=mesh, stages=built, wrapped=wrapped, specs=specs, pipeline=pipeline, layout=layout,
                     ties=ties, data_parallel=data_parallel, schedule=cls.__name__.removeprefix("Schedule"),
                     guards=guards, input_check=InputCheck(mesh["tp"].get_group(), mode=check_inputs, names=names,
                                                           where="HybridModel.step"),
                     scaler=LossScaler() if mixed_precision == "fp16" else None)
    if weights is not None:
        _load(hm, weights, on_meta)
    return hm


def _check_no_dropout(gm: nn.Module) -> None:
    """Per-block recomputation runs forward again in backward; a live dropout would draw other masks there."""
    why = live_dropout(gm)
    if why is not None:
        raise TPCompileError(f"activation_checkpointing with dropout: {why} would draw different masks when backward "
                             f"recomputes it; use activation_checkpointing='selective' (it keeps the masks), set the "
                             f"model's dropout to 0 or call model.eval(), or pass activation_checkpointing=False")


def _aliases(gm: nn.Module) -> dict[str, list[str]]:
    """Every tensor's first name -> all its names (tied weights have several)."""
    by_id: dict[int, list[str]] = {}
    named = list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False))
    for name, t in named:
        by_id.setdefault(id(t), []).append(name)
    return {names[0]: names for names in by_id.values()}


def _load(hm: HybridModel, weights: Any, on_meta: bool) -> None:
    """Fill the local slices and shards from full weights or a DCP checkpoint saved at any layout."""
    from tpcompile.hybrid.checkpoint import load_into
    load_into(hm, weights, on_meta=on_meta)
