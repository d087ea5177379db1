"""Rules for layout ops whose split needs tpcompile's own placements: heads held in pieces shared by ranks.

Ops DTensor can place (stack, view_as_complex, flip, ...) have no row and go through the
fallback (dtensor_fallback.py), which also carries segments, pieces and batch x heads layouts
through ops that keep the split dim's size. What remains is an op that changes the size of a
dim split in pieces: grouped-query attention's `repeat_interleave` of kv heads, when there are
fewer kv heads than ranks; `repeat` on the other dims of any split, zero-padded ones included; and `pad` along dims
the split does not touch (Mamba-2's chunk padding of the tokens, its B and C whole on every rank: DTensor's strategy
replicates a dim of fewer entries than ranks).
"""
from __future__ import annotations

from dataclasses import replace

from torch.fx import Node

from tpcompile.layouts import holders
from tpcompile.placement import REPLICATE, Replicate, Shard, moved, pad_cuts, seg_cuts, split_dims
from tpcompile.sharding_rules.dtensor_fallback import dtensor_result
from tpcompile.sharding_rules.group_cuts import even_within, group_cuts, per_rank
from tpcompile.sharding_rules.registry import rule
from tpcompile.sharding_rules.rule_context import Result, RuleContext, Want, norm_dim
from tpcompile.sharding_rules.shared_pieces import piece_resized
from tpcompile.sharding_rules.table import RuleSpec


@rule("repeat_interleave", args={"repeats_arg": int, "dim_arg": int})
def repeat_interleave(node: Node, spec: RuleSpec, ctx: RuleContext) -> Result:
    """repeat_interleave(x, r, dim): kv heads repeated for their query heads.

    Along a dim the split does not touch, the split is kept. Along the split dim, each rank's entries
    repeated are its part of the output. When the dim is split in pieces with one kv head each (fewer kv
    heads than ranks), the ranks sharing a piece each keep their own query heads: the local repeat count
    is r / (ranks per piece), and the output is split evenly.
    """
    x = node.args[0]
    p = ctx.placement(x)
    if isinstance(p, Replicate):
        return Result(REPLICATE, [Want(x, REPLICATE)])
    i, j = spec.get("repeats_arg"), spec.get("dim_arg")
    repeats = node.args[i] if i < len(node.args) else None
    dim = node.args[j] if j < len(node.args) else node.kwargs.get("dim")
    if dim is None or not isinstance(repeats, int):  # (an output_size hint is dropped where the output is split)
        return dtensor_result(node, ctx) or _fail(x, "repeats the flattened value, or a tensor of repeats")
    dim = norm_dim(dim, len(ctx.shape(x)))
    if dim != p.dim:
        return Result(p, [Want(x, p)])
    if p.pieces is None:
        if p.plain_padded:  # each rank repeats its padded entries: the padding, repeated, stays at the end
            return Result(replace(p, cuts=pad_cuts(p.padded * repeats, ctx.world_size)), [Want(x, p)])
        if p.padding is not None or p.outer is not None or p.rank_cuts:
            return _fail(x, f"repeats along a dim split as {p}")
        segments = None if p.segments is None else tuple(s * repeats for s in p.segments)
        cuts = None if p.cuts is None else seg_cuts(segments, ctx.world_size, counts=p.counts(ctx.world_size))
        return Result(replace(p, segments=segments, cuts=cuts), [Want(x, p)])
    share = holders(ctx.world_size, p.pieces)  # ranks holding each piece
    size = ctx.shape(x)[dim]
    if p.pieces == 1 and p.split_next is None and repeats % share:  # whole on every rank: repeated whole, each
        # rank later reading its part (its padded heads, sharding_rules/matmul.py)
        return Result(piece_resized(p, ctx.shape(node)[dim]), [Want(x, p)])
    even = even_within(repeats, share, p.pieces, ctx.world_size)
    if spec.get("pad_within") and p.split_next is None and size == p.pieces and not even:
        # one head a piece, its repeats cut among the ranks sharing it, zero-padded (passes/head_repeats.py marks
        # it): each rank repeats its head per_rank times, the copies past the group are padding
        cuts = group_cuts(p.pieces, repeats, 1, share, ctx.world_size)
        return Result(Shard(dim, (repeats,) * p.pieces, seq=p.seq, cuts=cuts), [Want(x, p)],
                      localize=[("set", i, per_rank(repeats, p.pieces, ctx.world_size), None)])
    if p.split_next is not None or not isinstance(size, int) or size != p.pieces or not even:
        return replace(_fail(x, f"{size} entries in {p.pieces} pieces repeated {repeats} times do not give each of "
                                f"the {share} ranks sharing a piece whole entries of its own"), unpiece=[x])
    return Result(Shard(dim, seq=p.seq), [Want(x, p)], localize=[("split", i, None, share)])


@rule("pad", args={"pad_arg": int})
def pad(node: Node, spec: RuleSpec, ctx: RuleContext) -> Result:
    """F.pad / constant_pad_nd: padding only dims the split does not touch keeps the split; otherwise DTensor's
    strategy decides."""
    x = node.args[0]
    p = ctx.placement(x)
    if not isinstance(p, Shard):
        return Result(REPLICATE, [Want(x, REPLICATE)])
    amounts = list(node.args[spec.get("pad_arg")])
    nd = len(ctx.shape(x))
    touched = {nd - 1 - i // 2 for i, a in enumerate(amounts) if not (isinstance(a, int) and a == 0)}
    if touched & set(split_dims(p)):
        return dtensor_result(node, ctx) or _fail(x, f"pads the split dim {p.dim}")
    return Result(p, [Want(x, p)])


def _fail(x: Node, why: str) -> Result:
    return Result(REPLICATE, [Want(x, REPLICATE)], conflict=why)


@rule("repeat")
def repeat(node: Node, spec: RuleSpec, ctx: RuleContext) -> Result:
    """x.repeat(*sizes): tiles x, new dims in front. A split dim repeated once keeps its split (on the dim it
    becomes); repeated r times, each rank's blocks tiled are its blocks of r copies of the split, segments of
    their own (DiffLlama's halves of the value heads, each repeated for every query head); refused in pieces or
    blocks of its own (the ranks' tiles would interleave)."""
    x, sizes = node.args[0], list(node.args[1])
    p = ctx.placement(x)
    if not isinstance(p, Shard):
        return Result(REPLICATE, [Want(x, REPLICATE)])
    lead = len(sizes) - len(ctx.shape(x))
    r, size = sizes[lead + p.dim], ctx.shape(x)[p.dim]
    if r != 1 and isinstance(r, int) and isinstance(size, int) and split_dims(p) == (p.dim,) and p.pieces is None \
            and p.outer is None and not p.seq and not p.rank_cuts:
        copies = replace(p, segments=tuple(p.segments or (size,)) * r, cuts=None if p.cuts is None else p.cuts * r)
        return Result(moved(copies, lead + p.dim), [Want(x, p)])
    if any(sizes[lead + d] != 1 for d in split_dims(p)):  # in pieces: asks for them one to a rank first
        return replace(_fail(x, f"repeats along the split dim {p.dim} ({sizes[lead + p.dim]} times)"),
                       unpiece=[x] if p.pieces else None)
    return Result(moved(p, lead + p.dim), [Want(x, p)])
