"""Checkpoints and weights of a hybrid model: every rank's tensors as chunks of the full tensors.

A rank holds, of each tensor, its tensor-parallel slice (tpcompile.placement.rank_pieces) and,
under FSDP, only its data-parallel rows of that slice (a DTensor sharded on dim 0 over "dp").
`rank_chunks` turns that into (global offset, local view) pairs of the *full* tensor with its
true global shape, which is what `tpcompile.dcp.save/load` write and read (so a checkpoint saved
at one (dp, tp, pp) loads at any other, or into the plain model with torch.distributed.checkpoint),
and what `load_weights` fills from a full state dict or .safetensors files, slice by slice.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from tpcompile.checkpoint.dcp import RankChunks
from tpcompile.checkpoint.weights import WeightSource, open_weights
from tpcompile.errors import TPCompileError
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


def rank_chunks(value: torch.Tensor, spec: TensorSpec, tp_rank: int, tp: int) -> list[Chunk]:
    """The chunks of the full tensor that this rank's `value` (plain, or an FSDP DTensor) holds."""
    if isinstance(value, DTensor):  # FSDP: this rank's rows of the tensor-parallel slice
        _, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        return local_chunks(value.to_local(), offset[0] if offset else 0, spec, tp_rank, tp)
    return local_chunks(value, 0, spec, tp_rank, tp)


def local_chunks(local: torch.Tensor, row0: int, spec: TensorSpec, tp_rank: int, tp: int) -> list[Chunk]:
    """The chunks of the full tensor in `local`: rows row0.. of TP rank tp_rank's slice of it."""
    if local.numel() == 0:
        return []
    nd, full, sl = local.dim(), spec.global_shape, spec.slice
    if sl is None:
        return [(tuple(row0 if d == 0 else 0 for d in range(nd)), local)]
    out: list[Chunk] = []
    rows = local.shape[0]
    for start, at, n in rank_pieces(sl, full[sl.dim], tp_rank, tp):
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


def load_weights(held: Iterator[tuple[torch.Tensor, TensorSpec]], weights: Any, tp_rank: int, tp: int, *,
                 on_meta: bool) -> None:
    """Fill this rank's tensors in place from full-size weights (a state dict, .safetensors or .pt files).

    A tensor the weights lack keeps its value, unless the model was built on the meta device (it has none).
    """
    src = open_weights(weights)
    missing: list[str] = []
    with torch.no_grad():
        for value, spec in held:
            key = next((a for a in (spec.name, *spec.aliases) if a in src), None)
            if key is None:
                if on_meta:
                    missing.append(spec.name)
                continue
            stored = tuple(src.shape(key))
            if stored != tuple(spec.global_shape):
                raise TPCompileError(f"weight {key!r} has shape {list(stored)} in the weights but "
                                     f"{list(spec.global_shape)} in the model; load weights of this model's config")
            for offsets, view in rank_chunks(value.detach(), spec, tp_rank, tp):
                view.copy_(_read(src, key, offsets, tuple(view.shape)))
    if missing:
        raise TPCompileError(f"the weights lack {len(missing)} tensor(s) the model needs: {', '.join(missing[:5])}"
                             f"{' ...' if len(missing) > 5 else ''}; add them to the state dict (non-persistent "
                             f"buffers too) or build the model on a real device instead of meta")
