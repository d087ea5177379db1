"""Rules for ops that join several values into one: cat along a kept dim (or along the split dim, into segments),
stack along a new one."""
from __future__ import annotations

from typing import Optional

from torch.fx import Node

from tpcompile.placement import REPLICATE, Shard, moved, seg_cuts, split_dims
from tpcompile.sharding_rules.registry import rule
from tpcompile.sharding_rules.rule_context import Result, RuleContext, Want
from tpcompile.sharding_rules.shape import ALONG, along
from tpcompile.sharding_rules.table import RuleSpec


@rule("cat", args=ALONG)
def cat(node: Node, spec: RuleSpec, ctx: RuleContext) -> Result:
    """cat along a dim other than the sharded one; replicated pieces are sliced locally (an empty 1-D tensor,
    which cat skips, as it is)."""
    tensors = [t for t in node.args[0] if not _skipped(ctx.shape(t))]
    skipped = [t for t in node.args[0] if _skipped(ctx.shape(t))]
    ndim = len(ctx.shape(node))
    as_is = [Want(t, REPLICATE) for t in skipped]
    if ctx.all_replicated(tensors):
        return Result(REPLICATE, [Want(t, REPLICATE) for t in tensors] + as_is)
    dim = along(node, spec, ndim)
    placements = {ctx.placement(t) for t in tensors if isinstance(ctx.placement(t), Shard)}
    target = placements.pop()
    if placements or dim in split_dims(target):
        joined = _segments_of(tensors, dim, ctx)
        if joined is not None:  # each rank joins its blocks: the segments layout of a fused projection
            return Result(joined, [Want(t, ctx.placement(t)) for t in tensors] + as_is)
        return Result(REPLICATE, [Want(t, REPLICATE) for t in tensors] + as_is,
                      conflict="cat of differently sharded values or along the sharded dim")
    return Result(target, [Want(t, target) for t in tensors] + as_is)


def _segments_of(tensors: list, dim: int, ctx: RuleContext) -> Optional[Shard]:
    """cat along the dim every operand is split on (q, k and v projected apart, then joined for one convolution, as
    linear-attention layers do): rank r's blocks joined are its part of a split in segments, the operands' sizes (their
    own segments and zero padding carried over; an operand in fewer pieces than ranks, k of 2 kv heads at 4 ranks,
    a segment in as many pieces; one cut per rank, v's heads cut within their kv groups, its cuts). None when an
    operand is whole or split otherwise."""
    segs: list = []
    pads: list = []
    pieces: list = []  # per segment, its pieces: the world size, or fewer (k of kv heads fewer than the ranks)
    cut: dict = {}  # segment index -> its cuts, for an operand cut per rank (value heads cut within their groups)
    for t in tensors:
        p, size = ctx.placement(t), ctx.shape(t)[dim]
        if not isinstance(p, Shard) or p.dim != dim or p.seq or not isinstance(size, int) or \
                p.shared(ctx.world_size) and p.pieces is None or p.outer is not None or p.split_next is not None:
            return None
        if p.rank_cuts:
            cut.update({len(segs) + i: c for i, c in enumerate(p.cuts)})
            segs, pads, pieces = segs + list(p.segments), pads + list(p.segments), pieces + [1] * len(p.segments)
            continue
        own = list(p.segments) if p.segments else [size]
        segs += own
        pads += [p.padded] if p.padded is not None else p.pads() if p.cuts is not None else own
        pieces += [p.pieces or ctx.world_size] * len(own)
        if p.padded is not None and len(own) != 1:
            return None
    if len(segs) < 2:
        return None
    cuts = seg_cuts(segs, ctx.world_size, pads, pieces)
    if cut:
        cuts = tuple(cut.get(i, c) for i, c in enumerate(cuts))
    return Shard(dim, tuple(segs), cuts=cuts)


def _skipped(shape: object) -> bool:
    """A 1-D tensor of size 0: torch.cat leaves it out whatever the other tensors' shapes (legacy behaviour)."""
    return isinstance(shape, tuple) and len(shape) == 1 and shape[0] == 0


@rule("stack", args=ALONG)
def stack(node: Node, spec: RuleSpec, ctx: RuleContext) -> Result:
    """stack: values split alike stay split, the split dim shifted past the new one; whole ones are sliced locally."""
    tensors = list(node.args[0])
    if ctx.all_replicated(tensors):
        return Result(REPLICATE, [Want(t, REPLICATE) for t in tensors])
    dim = along(node, spec, len(ctx.shape(node)))
    placements = {ctx.placement(t) for t in tensors if isinstance(ctx.placement(t), Shard)}
    target = placements.pop()
    if placements:
        return Result(REPLICATE, [Want(t, REPLICATE) for t in tensors], conflict="stack of differently split values")
    return Result(moved(target, target.dim + (target.dim >= dim)), [Want(t, target) for t in tensors])
