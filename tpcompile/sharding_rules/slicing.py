"""Rules for ops that take part of a tensor: slice, select, and indexing by a tensor of positions.

Along a split dim, a slice is fine when it takes whole segments: a fused projection read as
`qkv[..., :q_size]`, `qkv[..., q_size:q_size + kv_size]` (Phi-3) is split per segment (annotate's
segment hint), so each slice is this rank's part of one segment, at local positions that are the
global ones divided by the world size.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch.fx import Node

from tpcompile.layouts import dim_layout
from tpcompile.placement import (PARTIAL, REPLICATE, Replicate, Shard, cut_shard, moved, pad_cuts, piece_shard,
                                 segmented, split_dims)
from tpcompile.sharding_rules.registry import rule
from tpcompile.sharding_rules.rule_context import Result, RuleContext, Want, norm_dim, sizes_equal
from tpcompile.sharding_rules.table import RuleSpec

_ALONG = {"dim_arg": int, "default_dim": int}
_END = 2 ** 62  # slice ends at or past this are "to the end" (torch writes sys.maxsize)


def _fail(node: Node, why: str, extra: tuple = ()) -> Result:
    return Result(REPLICATE, [Want(node.args[0], REPLICATE)] + [Want(n, REPLICATE) for n in extra], conflict=why)


def _along(node: Node, spec: RuleSpec, ctx: RuleContext) -> tuple[Node, Any, int]:
    """The input, its placement and the op's dim argument, for ops that act along one dim."""
    x, i = node.args[0], spec.get("dim_arg")
    dim = node.args[i] if i < len(node.args) else node.kwargs.get("dim", spec.get("default_dim", 0))
    return x, ctx.placement(x), norm_dim(dim, len(ctx.shape(x)))


def _bound(v: Any, size: int, default: int) -> Optional[int]:
    """A slice bound as a position in [0, size], or None when it is not a literal."""
    if v is None:
        return default
    if not isinstance(v, int):
        return None
    return size if v >= _END else max(0, min(size, v + size if v < 0 else v))


@rule("slice", args=_ALONG)
def slice_(node: Node, spec: RuleSpec, ctx: RuleContext) -> Result:
    """slice: any dim but the split one; along it, the whole dim or whole segments of it."""
    x, p, dim = _along(node, spec, ctx)
    if isinstance(p, Replicate):
        return Result(REPLICATE, [Want(x, REPLICATE)])
    size = ctx.shape(x)[dim]
    if dim not in split_dims(p) or sizes_equal(size, ctx.shape(node)[dim]):
        return Result(p, [Want(x, p)])
    args = list(node.args) + [None] * (5 - len(node.args))
    start, end = (_bound(args[2], size, 0), _bound(args[3], size, size)) if isinstance(size, int) else (None, None)
    step = args[4]
    full = p.padded if p.plain_padded else size if p.plain and not p.seq else None
    if isinstance(step, int) and step > 1 and isinstance(full, int) and start is not None and start < step \
            and end == size and full % (ctx.world_size * step) == 0:
        # every step-th entry (gpt-oss's interleaved gate|up, `[..., ::2]` and `[..., 1::2]`): each rank's block
        # holds whole strides, so its own strided entries are the rank's share of the global ones; of a zero-padded
        # split, the strides past the size are the result's padding
        ends = [("set", 3, full // ctx.world_size, None)] if len(node.args) > 3 and node.args[3] == size else []
        real = -(-(size - start) // step)
        out = Shard(dim) if real * step == full else Shard(dim, cuts=pad_cuts(full // step, ctx.world_size))
        return Result(out, [Want(x, p)], localize=ends)
    if start is None or end is None or args[4] not in (None, 1):
        return _fail(node, "slice along the split dim")
    segs, ws = list(p.segments or (size,)), ctx.world_size
    bounds = [sum(segs[:k]) for k in range(len(segs) + 1)]
    if start not in bounds or end not in bounds or start >= end:
        return _fail(node, f"slice [{start}:{end}] along the split dim cuts through its segments {tuple(segs)}")
    if p.padded or p.outer or p.pieces:
        return _fail(node, f"slice [{start}:{end}] along the split dim, split as {p}")
    i0, i1 = bounds.index(start), bounds.index(end)
    present = [i for i in (2, 3) if i < len(node.args) and isinstance(node.args[i], int)]
    if p.cuts is None:  # every segment split evenly: a boundary's local position is the global one / ws
        return Result(segmented(dim, segs[i0:i1], ws), [Want(x, p)],
                      localize=[("split", i, dim, None) for i in present])
    # segments cut otherwise (padded, in fewer pieces than ranks, or one piece a rank): whole ones, at the local
    # positions of their bounds, which must be the same on every rank
    layout = dim_layout(p, None, ws)
    at = {tuple(sum(b - a for a, b in layout.blocks(r)[:i]) for i in (i0, i1)) for r in range(ws)}
    if len(at) != 1:
        return _fail(node, f"slice [{start}:{end}] of segments cut as {p} starts or ends at different positions "
                           f"on the ranks")
    local = dict(zip((2, 3), at.pop()))
    return Result(cut_shard(dim, segs[i0:i1], p.cuts[i0:i1], ws), [Want(x, p)],
                  localize=[("set", i, local[i], None) for i in present])


@rule("select", args={"dim_arg": int})
def select(node: Node, spec: RuleSpec, ctx: RuleContext) -> Result:
    """select: removes a dim other than the split one; one entry along a dim split in even blocks (a table's
    padding row, `table[pad_id]`) is held by one rank, which gives it while the others give zeros: a pending sum
    (role `owned`), reduced with the sums it joins (the token embeddings')."""
    x, p, dim = _along(node, spec, ctx)
    if isinstance(p, Replicate):
        return Result(REPLICATE, [Want(x, REPLICATE)])
    if dim in split_dims(p):
        if _owned_entry(node, p, dim, ctx):
            return Result(PARTIAL, [Want(x, p)], role="owned")
        return _fail(node, "select along the split dim")
    return Result(moved(p, p.dim - (dim < p.dim)), [Want(x, p)])


def _owned_entry(node: Node, p: Shard, dim: int, ctx: RuleContext) -> bool:
    """A literal index along `dim` of a float parameter split by `p` in one run of even blocks (zero-padded or not):
    exactly one rank holds the entry. (An activation's entry stays a conflict: its producer kept whole costs no
    collective, a pending entry one per read.)"""
    shape, val = ctx.shape(node.args[0]), node.meta.get("val")
    return (ctx.param(node.args[0]) is not None and p.dim == dim and (p.plain or p.plain_padded) and not p.seq
            and not p.split_next and isinstance(node.args[2] if len(node.args) > 2 else None, int)
            and isinstance(shape[dim], int) and isinstance(val, torch.Tensor) and val.is_floating_point())


@rule("index")
def index(node: Node, spec: RuleSpec, ctx: RuleContext) -> Result:
    """x[ids] (aten.index.Tensor): gathers along dims other than the split one; the positions stay whole."""
    x, idx = node.args[0], list(node.args[1])
    ids = [i for i in idx if isinstance(i, Node)]
    p = ctx.placement(x)
    if ctx.all_replicated([x, *ids]):
        return Result(REPLICATE, [Want(n, REPLICATE) for n in [x, *ids]])
    if not ctx.all_replicated(ids):
        return _fail(node, "indexes with split positions", tuple(ids))
    taken = [k for k, i in enumerate(idx) if i is not None]
    if taken == [p.dim] and spec.get("positions") and _whole_pick(p, spec.get("positions"), ctx.shape(x)[p.dim]):
        out = piece_shard(p.dim, ctx.shape(node)[p.dim], 1)
        return Result(out, [Want(x, p)] + [Want(i, REPLICATE) for i in ids])
    if set(split_dims(p)) & set(taken) or taken != list(range(taken[0], taken[-1] + 1)):
        return _fail(node, f"gathers along the split dim {p.dim}", tuple(ids))
    new = max(len(ctx.shape(i)) for i in ids)  # the positions' (broadcast) dims replace the indexed ones
    out = p.dim if p.dim < taken[0] else p.dim - len(taken) + new
    return Result(moved(p, out), [Want(x, p)] + [Want(i, REPLICATE) for i in ids])


def _whole_pick(p: Shard, positions: tuple, size: Any) -> bool:
    """True when constant `positions` along the split dim lie in one segment whole on every rank, and every
    segment between it and the end they count from is whole too, so they are the same positions locally
    (Falcon's multi-query `qkv[..., [-2], :]` picks its one key head)."""
    if not isinstance(size, int) or not p.even_segments or p.pieces or len(set(q < 0 for q in positions)) != 1:
        return False
    counts = [len(c) - 1 for c in p.cuts]
    bounds = [sum(p.segments[:k]) for k in range(len(p.segments) + 1)]
    at = {next(k for k in range(len(p.segments)) if bounds[k] <= q % size < bounds[k + 1]) for q in positions}
    if len(at) != 1:
        return False
    i = at.pop()
    return all(g == 1 for g in (counts[i:] if positions[0] < 0 else counts[:i + 1]))


@rule("gather")
def gather(node: Node, spec: RuleSpec, ctx: RuleContext) -> Result:
    """torch.gather(x, dim, index): out[..., i, ...] = x[..., index[..., i, ...], ...] along `dim`. Split along
    another dim where x and index have the same size, zero-padded splits included: each rank gathers from its own
    rows with its own rows of the index (a local slice of a whole index)."""
    x, index = node.args[0], node.args[2]
    dim = norm_dim(node.args[1], len(ctx.shape(x)))
    if ctx.all_replicated([x, index]):
        return Result(REPLICATE, [Want(x, REPLICATE), Want(index, REPLICATE)])
    split = [ctx.placement(n) for n in (x, index) if isinstance(ctx.placement(n), Shard)]
    p = split[0]
    if any(q != p for q in split) or dim in split_dims(p) or p.seq:
        return _fail(node, "gathers along the split dim or from differently split values", (index,))
    if not all(sizes_equal(ctx.shape(x)[d], ctx.shape(index)[d]) for d in split_dims(p)):
        return _fail(node, f"the index is smaller than the input along the split dim {p.dim}", (index,))
    return Result(p, [Want(x, p), Want(index, p)])
