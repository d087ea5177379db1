"""Where each parameter's values lie in the full tensor: the chunk arithmetic optimizer state shares with its parameter.

A rank holds a parameter whole (a plain module, a replicated weight), as a tensor-parallel slice
(a parallelize rank module: tpcompile.placement.rank_pieces), or as a slice's FSDP rows (a
HybridModel: tpcompile.hybrid.checkpoint). A ParamLayout gives, for any tensor laid out like the
parameter (AdamW's moments), its chunks of the full tensor at their global offsets.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from tpcompile.checkpoint.dcp import RankChunks, is_plain, resolve
from tpcompile.placement import rank_pieces

__all__ = ["Chunk", "ParamLayout", "param_layouts"]

Chunk = tuple[tuple[int, ...], torch.Tensor]  # (offset in the full tensor, view of this rank's storage)


@dataclass(frozen=True)
class ParamLayout:
    """A parameter this rank holds: the model's name for it, its global shape, and its chunk arithmetic."""

    name: str
    param: torch.Tensor  # this rank's parameter (a slice, an FSDP DTensor shard, or the whole tensor)
    global_shape: tuple[int, ...]
    chunks: Callable[[torch.Tensor], list[Chunk]]  # the full tensor's chunks in a tensor laid out like `param`
    aliases: tuple[str, ...] = ()  # its other names (a tied weight): a checkpoint may know it by any of them


def _whole(t: torch.Tensor) -> list[Chunk]:
    """A tensor held whole: one chunk at offset 0."""
    return [((0,) * t.dim(), t)]


def _sliced(t: torch.Tensor, *, full: tuple[int, ...], dim: int,
            pieces: list[tuple[int, int, int]]) -> list[Chunk]:
    """A rank module's slice as chunks of the full tensor."""
    return [(tuple(offsets), view) for offsets, view in RankChunks(t, full, dim, pieces).chunks]


def param_layouts(model: Any, sharded: Any = None, rank: Optional[int] = None) -> list[ParamLayout]:
    """Every parameter this rank holds with its names, global shape and chunk arithmetic (for optimizer state)."""
    own = getattr(model, "dcp_params", None)
    if callable(own):  # a HybridModel: TP slices and FSDP shards
        return own()
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    if is_plain(model, sharded):
        return [ParamLayout(name, p, tuple(p.shape), _whole, tuple(names[id(p)][1:]))
                for name, p in model.named_parameters()]
    sharded, rank = resolve(model, sharded, rank)
    ws = sharded.world_size
    out = []
    for name, p in model.named_parameters():
        sl, full = sharded.slice_for(name), sharded.full_shape(name)
        chunks = _whole if sl is None else functools.partial(
            _sliced, full=full, dim=sl.dim, pieces=rank_pieces(sl, full[sl.dim], rank, ws))
        out.append(ParamLayout(name, p, full, chunks, tuple(names[id(p)][1:])))
    return out
