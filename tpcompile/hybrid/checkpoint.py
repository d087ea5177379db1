"""Checkpoints and weights of a hybrid model: every rank's tensors as chunks of the full tensors.

A rank holds, of each tensor, its tensor-parallel slice (tpcompile.placement.rank_pieces) and,
under FSDP, only its data-parallel rows of that slice (a DTensor sharded on dim 0 over "dp").
`rank_chunks` turns that into (global offset, local view) pairs of the *full* tensor with its
true global shape, which is what `tpcompile.dcp.save/load` write and read (so a checkpoint saved
at one (dp, tp, pp) loads at any other, or into the plain model with torch.distributed.checkpoint),
and what `load_into` fills from a full state dict, .safetensors/.pt files or a DCP checkpoint.
Names and buffers are the plain model's state_dict()'s: a non-persistent buffer is never saved
nor required. A stage built on meta notes which tensors have no value (real_buffers); those must
come from the weights, while a buffer built on a real device keeps its value.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.fx import GraphModule

from tpcompile.checkpoint.buffers import no_value_error
from tpcompile.checkpoint.dcp import Group, RankChunks
from tpcompile.checkpoint.dcp_checks import Want
from tpcompile.checkpoint.layouts import ParamLayout
from tpcompile.checkpoint.weights import WeightSource, describe, open_weights
from tpcompile.layouts import dim_layout
from tpcompile.placement import ParamSlice, rank_pieces

Chunk = tuple[tuple[int, ...], torch.Tensor]  # (offset in the full tensor, view of this rank's storage)


@dataclass(frozen=True)
class TensorSpec:
    """A tensor of the original model as the hybrid model holds it."""

    name: str  # the name every piece reads it by (the first of tied names)
    aliases: tuple[str, ...]  # its names in the model's state dict (empty: not saved, e.g. a non-persistent buffer)
    global_shape: tuple[int, ...]
    slice: Optional[ParamSlice]  # how tensor parallelism cuts it (None: whole on every TP rank)


class HybridChunks(RankChunks):
    """RankChunks built from chunks given directly (several dims may be cut)."""

    def __init__(self, global_shape: tuple[int, ...], chunks: list[Chunk]) -> None:
        self.global_shape = torch.Size(global_shape)
        self.chunks = [(torch.Size(offsets), view) for offsets, view in chunks]


def rank_chunks(value: torch.Tensor, spec: TensorSpec, tp_rank: int, tp: int, owned: bool = False) -> list[Chunk]:
    """The chunks of the full tensor that this rank's `value` (plain, or an FSDP DTensor) holds (`owned`: only
    those of pieces it is the first TP rank to hold, each element once over the TP ranks)."""
    if isinstance(value, DTensor):  # FSDP: this rank's rows of the tensor-parallel slice
        _, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        return local_chunks(value.to_local(), offset[0] if offset else 0, spec, tp_rank, tp, owned)
    return local_chunks(value, 0, spec, tp_rank, tp, owned)


def local_chunks(local: torch.Tensor, row0: int, spec: TensorSpec, tp_rank: int, tp: int,
                 owned: bool = False) -> list[Chunk]:
    """The chunks of the full tensor in `local`: rows row0.. of TP rank tp_rank's slice of it (`owned`: of the
    pieces of the slice it is the first TP rank to hold; a tensor kept whole: on TP rank 0)."""
    if local.numel() == 0:
        return []
    nd, full, sl = local.dim(), spec.global_shape, spec.slice
    if sl is None:
        return [] if owned and tp_rank else [(tuple(row0 if d == 0 else 0 for d in range(nd)), local)]
    out: list[Chunk] = []
    rows = local.shape[0]
    runs = dim_layout(sl, full[sl.dim], tp).owned(tp_rank) if owned else rank_pieces(sl, full[sl.dim], tp_rank, tp)
    for start, at, n in runs:
        offsets = [0] * nd
        if sl.dim == 0:  # the data-parallel rows and the tensor-parallel runs cut the same dim
            a, b = max(at, row0), min(at + n, row0 + rows)
            if a >= b:
                continue
            offsets[0] = start + a - at
            out.append((tuple(offsets), local.narrow(0, a - row0, b - a)))
        else:
            offsets[0], offsets[sl.dim] = row0, start
            out.append((tuple(offsets), local.narrow(sl.dim, at, n)))
    return out


def param_layouts(params: Iterator[tuple[torch.Tensor, TensorSpec]], tp_rank: int, tp: int) -> list[ParamLayout]:
    """Each parameter copy this rank holds, with the chunk arithmetic of its slice and shard (for optimizer state)."""
    return [ParamLayout(spec.name, p, tuple(spec.global_shape),
                        functools.partial(rank_chunks, spec=spec, tp_rank=tp_rank, tp=tp), spec.aliases)
            for p, spec in params]


def dcp_state(held: Iterator[tuple[torch.Tensor, TensorSpec]], tp_rank: int, tp: int) -> dict[str, Any]:
    """{state-dict name: HybridChunks} of the tensors this rank holds, for tpcompile.dcp.save/load."""
    state: dict[str, Any] = {}
    for value, spec in held:
        chunks = rank_chunks(value.detach(), spec, tp_rank, tp)
        if chunks:
            for name in spec.aliases:
                state[name] = HybridChunks(spec.global_shape, chunks)
    return state


def _read(src: WeightSource, key: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    """The region [offsets, offsets + shape) of the stored tensor `key`, read one dim at a time."""
    full = src.shape(key)
    cut = [d for d in range(len(full)) if offsets[d] != 0 or shape[d] != full[d]]
    if not cut:
        return src.read(key)
    out = src.read(key, cut[0], offsets[cut[0]], shape[cut[0]])
    for d in cut[1:]:
        out = out.narrow(d, offsets[d], shape[d])
    return out


UNVALUED = "tpcompile_unvalued"  # stage.meta key: model names of the stage's tensors built on meta, not yet loaded


def real_buffers(stage: GraphModule) -> dict[str, torch.Tensor]:
    """Before a stage built on meta is materialised: copies of its buffers that have values; the rest noted.

    A buffer with a value (of a module the user built on a real device, such as a rotary table)
    needs no weights: restore_buffers() puts it back after to_empty() has replaced every tensor.
    The model names of the tensors without one go to stage.meta[UNVALUED], which the loaders read.
    """
    names = stage.meta["names"]
    held = list(stage.named_parameters()) + list(stage.named_buffers())
    stage.meta[UNVALUED] = {names.get(n, n) for n, t in held if t.is_meta}
    return {n: b.detach().clone() for n, b in stage.named_buffers() if not b.is_meta}


def restore_buffers(stage: GraphModule, kept: dict[str, torch.Tensor]) -> None:
    """Copy the values real_buffers() kept back into the materialised stage."""
    with torch.no_grad():
        for name, value in kept.items():
            stage.get_buffer(name).copy_(value)


def _held(hm: Any) -> Iterator[tuple[torch.Tensor, TensorSpec, bool, bool]]:
    """(tensor, spec, is a buffer, has a value) of every tensor this rank's stages hold."""
    for idx in hm.stage_indices:
        stage = hm.stages[idx]
        names, unvalued = stage.meta["names"], stage.meta.get(UNVALUED, set())
        buffers = list(stage.named_buffers())
        buffer_names = {n for n, _ in buffers}
        for name, t in list(stage.named_parameters()) + buffers:
            spec = hm.specs.get(names.get(name, name))
            if spec is not None:
                yield t, spec, name in buffer_names, spec.name not in unvalued


def load_groups(hm: Any) -> tuple[list[Group], set[str], Callable[[], None]]:
    """A HybridModel's tensors for tpcompile.dcp.load, every name of the model, and what to run after the load.

    A tensor several blocks of a stage hold (a shared buffer) is loaded into its first copy and
    copied into the others by the returned function, which also marks every tensor as having a value.
    """
    groups: list[Group] = []
    first: dict[str, torch.Tensor] = {}
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    for value, spec, buffer, valued in _held(hm):
        local = value.to_local() if isinstance(value, DTensor) else value
        if spec.name in first:
            copies.append((local, first[spec.name]))
            continue
        chunks = rank_chunks(value.detach(), spec, hm.tp_rank, hm.tp)
        if not chunks:
            continue
        first[spec.name] = local
        keys = spec.aliases or (spec.name,)  # a non-persistent buffer: read when a checkpoint has it
        want = Want(tuple(spec.global_shape), chunks[0][1].dtype, buffer=buffer, valued=valued,
                    optional=not spec.aliases)
        groups.append((keys, {k: HybridChunks(spec.global_shape, chunks) for k in keys}, want))
    known = {n for spec in hm.specs.values() for n in (spec.name, *spec.aliases)}

    def finish() -> None:
        with torch.no_grad():
            for dst, src in copies:
                dst.detach().copy_(src)
        for stage in hm.stages.values():
            stage.meta.pop(UNVALUED, None)
    return groups, known, finish


def load_into(hm: Any, weights: Any, *, on_meta: bool) -> None:
    """Fill a HybridModel from full weights or a tpcompile.dcp checkpoint saved at any layout (parallelize_train)."""
    if on_meta:  # stages materialised without real_buffers(): none of their tensors has a value
        for stage in hm.stages.values():
            if UNVALUED not in stage.meta:
                names = stage.meta["names"]
                stage.meta[UNVALUED] = {names.get(n, n) for n, _ in
                                        list(stage.named_parameters()) + list(stage.named_buffers())}
    if isinstance(weights, (str, os.PathLike)) and os.path.isfile(os.path.join(weights, ".metadata")):
        from tpcompile.checkpoint.dcp import load
        load(hm, weights)
        return
    _fill(((value, spec, valued) for value, spec, _, valued in _held(hm)), weights, hm.tp_rank, hm.tp)
    for stage in hm.stages.values():
        stage.meta.pop(UNVALUED, None)


def _fill(held: Iterator[tuple[torch.Tensor, TensorSpec, bool]], weights: Any, tp_rank: int, tp: int) -> None:
    """Copy each (tensor, spec, has a value) from the weights; one they lack is an error when it has no value."""
    src = open_weights(weights)
    missing: list[str] = []
    skipped: set[str] = set()
    with torch.no_grad():
        for value, spec, valued in held:
            key = next((a for a in (spec.name, *spec.aliases) if a in src), None)
            if key is None:
                if not valued:
                    missing.append(spec.name)
                    skipped.update(() if spec.aliases else (spec.name,))
                continue
            src.check(key, tuple(spec.global_shape), value.dtype)
            for offsets, view in rank_chunks(value.detach(), spec, tp_rank, tp):
                view.copy_(_read(src, key, offsets, tuple(view.shape)))
    if missing:
        raise no_value_error(missing, skipped, describe(weights))
