"""A placement claimed for an op, checked by running the op: on every rank's local slices of example
inputs, each rank's output must equal its part of the op's output on the whole inputs.

Splits DTensor cannot express (segments, pieces, batch x heads) are checked with each rank's
exact part (`positions`). DTensor's strategies are written per op by hand, and a few read their arguments in ways an
exported graph does not spell them (a positional `keepdim`), so each answer the fallback uses
is checked here once, on random inputs of the capture's shapes (integer inputs are zeros, valid
as indices), before it is trusted. Inputs above `_MAX_ELEMENTS` are checked by shape alone, on
meta tensors.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch.fx import Node

from tpcompile.layouts import block_of, dim_layout
from tpcompile.placement import Placement, Shard, segment_ranges

_MAX_ELEMENTS = 1 << 20


def _example(shape: Sequence[int], dtype: torch.dtype, gen: torch.Generator, device: str) -> torch.Tensor:
    if device == "meta" or not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool):
        return torch.zeros(shape, dtype=dtype, device=device)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def positions(p: Shard, size: int, rank: int, ws: int, outer: int = 1) -> list[int]:
    """The indices along p.dim that `rank` holds of a dim of `size` split as `p` (`outer`: p.outer's value)."""
    block = block_of(size, outer)  # in pieces: the one of the ranks sharing it, in every repetition; segments each
    # padded: the rank's block of each, in the dim's padded positions (asked at the padded size)
    if p.seg_padded:
        runs = dim_layout(p, None, ws).blocks(rank)
    elif p.pieces or p.seq:
        runs = dim_layout(p, size, ws, repeat=outer).blocks(rank)
    else:
        runs = segment_ranges(block, p.segments, rank, ws)
    return [b * block + i for b in range(outer) for start, stop in runs for i in range(start, stop)]


def _part(t: Any, p: Placement, rank: int, ws: int, outer: Callable[[Any], int]) -> Any:
    """Rank `rank`'s part of a whole value placed as `p`."""
    if not isinstance(t, torch.Tensor) or not isinstance(p, Shard):
        return t
    if p.plain and not p.seq:
        size = t.shape[p.dim] // ws
        return t.narrow(p.dim, rank * size, size)
    index = torch.tensor(positions(p, t.shape[p.dim], rank, ws, outer(p.outer) if p.outer is not None else 1))
    return t.index_select(p.dim, index.to(t.device))


def _call(node: Node, values: dict[Node, Any], sizes: dict[Node, int]) -> Any:
    def sub(a: Any) -> Any:
        if isinstance(a, Node):
            return values[a].clone() if a in values else sizes[a]
        if isinstance(a, (list, tuple)):
            return type(a)(sub(x) for x in a)
        return a
    return node.target(*sub(tuple(node.args)), **sub(dict(node.kwargs)))


def _same(got: Any, want: Any) -> bool:
    if not isinstance(want, torch.Tensor):
        return not isinstance(got, torch.Tensor)
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
        return False
    if got.device.type == "meta":
        return True
    if got.dtype.is_floating_point or got.dtype.is_complex:
        return bool(torch.allclose(got, want, rtol=1e-4, atol=1e-5, equal_nan=True))
    return bool(torch.equal(got, want))


def agrees(node: Node, inputs: Sequence[Node], shapes: Sequence[Sequence[int]], wants: Sequence[Placement],
           out: Any, sizes: dict[Node, int], world_size: int, outer: Callable[[Any], int] = int) -> bool:
    """True when running the op on each rank's slices (`wants`) gives each rank its part of the output (`out`).

    `outer` gives the value of a split's `outer` count (a size expression) at the example sizes.
    """
    gen = torch.Generator().manual_seed(0)
    big = sum(torch.Size(s).numel() for s in shapes) > _MAX_ELEMENTS
    device = "meta" if big else "cpu"
    whole = {n: _example(s, n.meta["val"].dtype, gen, device) for n, s in zip(inputs, shapes)}
    placed = dict(zip(inputs, wants))
    outs = out if isinstance(out, tuple) else (out,)
    try:
        with torch.no_grad():
            ref = _call(node, whole, sizes)
            refs = ref if isinstance(ref, (tuple, list)) else (ref,)
            if len(refs) != len(outs):
                return False
            for r in range(world_size):
                local = {n: _part(t, placed[n], r, world_size, outer) for n, t in whole.items()}
                got = _call(node, local, sizes)
                gots = got if isinstance(got, (tuple, list)) else (got,)
                if len(gots) != len(refs) or not all(
                        _same(g, _part(w, p, r, world_size, outer)) for g, w, p in zip(gots, refs, outs)):
                    return False
    except Exception:  # noqa: BLE001  the op refuses the example inputs or the local slices: not trusted
        return False
    return True
