"""Rule for convolutions with a weight parameter (1-, 2- and 3-D): split by channels, as a linear layer is by features.

A convolution fed a whole input is a column split: each rank computes its output channels (the
weight's dim 0 and the bias cut alike, zero-padded when the world size does not divide them), so its
output is split on the channel dim 1. One fed an
input split on its channels is a row split: each rank convolves its input channels (the weight's
dim 1) into a partial sum of every output channel, reduced once, the bias added after the
reduce. Whisper's two encoder convolutions and a CNN's consecutive layers are such pairs, with
one all-reduce between them. A convolution that starts a residual stream (a ViT's patch embedding:
its output, flattened into tokens, is read by the first norm and added to the first block's output)
is whole on every rank, as an embedding projection is (annotate marks it, passes/weight_roles.py),
so the blocks split as Megatron's.
A grouped convolution (depthwise: one group per channel, as Mamba's short causal convolution) convolves
whole groups per rank: on an input split by channels into whole groups per rank, its own groups, with
no communication; on a whole input, the channels of its own groups (a local slice, a column split). The
weight's dim 0 and the bias are cut alike, the output is split on its channels and the group count is
made local. Its weight may be a view of the parameter (`w.squeeze(1).unsqueeze(1)`). Channels joined in segments
(q|k) or held in pieces shared by several ranks (kv heads fewer than the ranks) are convolved the same way when
every rank's block of every segment is whole groups: a depthwise convolution always, one group per head when the
blocks are whole heads (the kernel's gradient summed over the ranks sharing a piece, passes/rewrite.py).
A transposed convolution (`conv_transpose*d`, `convolution(..., transposed=True)`) holds its weight as
(in, out / groups, *kernel): the column split cuts its dim 1, the row split its dim 0.
"""
from __future__ import annotations

from typing import Any, Optional

from torch.fx import Node

from tpcompile.layouts import dim_layout
from tpcompile.placement import (PARTIAL, REPLICATE, ParamSlice, Replicate, Shard, moved, pad_cuts, padded_size,
                                 param_cut)
from tpcompile.sharding_rules.registry import rule
from tpcompile.sharding_rules.rule_context import Result, RuleContext, Want, param_behind, undetached
from tpcompile.sharding_rules.table import RuleSpec


def _arg(node: Node, i: Optional[int], default: Any = None) -> Any:
    return node.args[i] if i is not None and i < len(node.args) else default


def _transposed(node: Node, spec: RuleSpec) -> bool:
    """The weight is laid out (in, out / groups, *kernel): a transposed convolution."""
    return spec.get("weight_layout") == "in_out" or bool(_arg(node, spec.get("transposed_arg"), False))


def _padded_channels(p: Any, channels: Any) -> bool:
    """A value split on its channels (dim 1) zero-padded past `channels` (the weight's input channels)."""
    return isinstance(p, Shard) and p.plain_padded and p.dim == 1 and isinstance(channels, int)


def _channel_split(p: Any) -> bool:
    """A value split plainly on its channels (dim 1), not by tokens."""
    return isinstance(p, Shard) and p.plain and p.dim == 1 and not p.seq


@rule("weight_conv", args={"input": int, "weight": int, "bias": int, "groups_arg": int, "transposed_arg": int,
                           "weight_layout": ("out_in", "in_out")})  # in_out: a transposed convolution's weight
def weight_conv(node: Node, spec: RuleSpec, ctx: RuleContext) -> Result:
    """A convolution whose channels are dim 1 of input and output: column split on a whole input, row split on
    one split by channels; grouped ones by whole groups."""
    x, w, b = (undetached(_arg(node, spec.get(k))) for k in ("input", "weight", "bias"))
    tensors = [n for n in (x, w, b) if isinstance(n, Node)]
    if _arg(node, spec.get("groups_arg"), 1) != 1:
        return _grouped(node, spec, ctx, tensors)
    if ctx.param(w) is None:  # an activation weight
        whole = [Want(n, REPLICATE) for n in tensors]
        return Result(REPLICATE, whole, conflict=None if ctx.all_replicated(tensors) else
                      "convolution with a computed weight on a split input")
    out_dim, in_dim = (1, 0) if _transposed(node, spec) else (0, 1)
    params: dict[Node, Optional[ParamSlice]] = {w: None, **({b: None} if isinstance(b, Node) else {})}
    px, channels = ctx.placement(x), ctx.shape(w)[out_dim]
    if ctx.demoted(node):
        return Result(REPLICATE, [Want(x, REPLICATE)], role="replicated", params=params)
    if isinstance(px, Replicate):
        if spec.get("embedding_projection"):  # marked by annotate (passes/weight_roles.py)
            return Result(REPLICATE, [Want(x, REPLICATE)], role="replicated", params=params,
                          note="embedding convolution: whole on every rank (its output is the residual stream "
                               "the layers read whole)")
        ws = ctx.world_size  # channels the world size does not divide: zero-padded, as a linear's features
        pad = None if channels % ws == 0 else -(-channels // ws) * ws
        cuts = None if pad is None else pad_cuts(pad, ws)
        params = {n: ParamSlice(out_dim if n is w else 0, cuts=cuts) for n in params}
        out = Shard(1, cuts=cuts)
        return Result(out, [ctx.replicated_want(x, out)], role="column", params=params)
    if _channel_split(px) or _padded_channels(px, ctx.shape(w)[in_dim]):
        params[w] = ParamSlice(in_dim, cuts=px.cuts)
        out = PARTIAL if not isinstance(b, Node) and not ctx.sequence_parallel else REPLICATE
        bias = [ctx.replicated_want(b, out)] if isinstance(b, Node) else []
        return Result(out, [Want(x, px)] + bias, role="row", params=params)
    return Result(REPLICATE, [Want(x, REPLICATE)], params=params,
                  conflict=f"input is split as {px}, not on its channels (dim 1)")


def _grouped(node: Node, spec: RuleSpec, ctx: RuleContext, tensors: list) -> Result:
    """groups > 1: each rank convolves the whole groups of its input channels (weight and bias cut on dim 0).

    Dim 0 of the weight runs over the groups in both layouts: (out, in / groups, ...) and, transposed,
    (in, out / groups, ...)."""
    x, w, b = (undetached(_arg(node, spec.get(k))) for k in ("input", "weight", "bias"))
    whole = [Want(n, REPLICATE) for n in tensors]
    found = param_behind(w, 0, depth=5)  # the parameter, its groups still in dim 0
    src = found[0] if found is not None and found[1] == 0 and ctx.param(found[0]) is not None else None
    px, groups = ctx.placement(x), _arg(node, spec.get("groups_arg"))
    kept = {} if src is None else {src: None, **({b: None} if isinstance(b, Node) and ctx.param(b) is not None
                                               else {})}
    if isinstance(px, Replicate) and src is None:  # (a weight view already cut as this rule cuts it is fine)
        if ctx.all_replicated(tensors):
            return Result(REPLICATE, whole)
        return Result(REPLICATE, whole, conflict="grouped convolution with a computed weight on a split input")
    if ctx.demoted(node):  # whole (a weight an earlier round cut is read whole)
        return Result(REPLICATE, whole, role="replicated", params=kept)
    if src is None:
        return Result(REPLICATE, whole, conflict="grouped convolution with a computed weight on a split input")
    channels = ctx.shape(x)[1] if ctx.shape(x) is not None and len(ctx.shape(x)) > 1 else None
    unit = (spec.get("heads") or (1,))[0] or 1  # the head size its channels are cut into later (annotate)
    if isinstance(px, Replicate) and groups == channels and channels >= ctx.world_size \
            and channels % (ctx.world_size * unit):
        # depthwise on a whole input, its channels zero-padded to a multiple of the ranks (by whole heads when
        # cut into heads later, Zamba's Mamba heads): a local slice each
        padded = Shard(1, cuts=pad_cuts(padded_size(channels, ctx.world_size * unit), ctx.world_size))
        return _own_groups(node, spec, ctx, src, padded, "column", padded)
    if isinstance(px, Replicate):  # a whole input: this rank's groups' channels are a local slice of it
        if groups % ctx.world_size:
            return Result(REPLICATE, whole, role="replicated", params=kept,
                          demote_self=f"{groups} groups not divisible by world size {ctx.world_size}")
        return _own_groups(node, spec, ctx, src, Shard(1), "column")
    if _padded_channels(px, channels) and groups == channels:  # depthwise on zero-padded channels (Mamba's)
        return _own_groups(node, spec, ctx, src, px, "channels", Shard(1, cuts=px.cuts))
    if groups == channels and (_segmented_channels(px) or _pieced_channels(px)):
        # depthwise over channels joined from several splits, or in pieces each shared by several ranks (kv heads
        # fewer than the ranks): the kernel cut alike, its gradient summed over the ranks sharing a piece
        return _own_groups(node, spec, ctx, src, px, "channels", px)
    if (_segmented_channels(px) or _pieced_channels(px)) and _whole_groups(ctx, node, spec, px, channels, groups):
        # groups of several channels (one per head) over channels joined from several splits or in shared pieces:
        # every piece is whole groups, so each rank convolves its own, the kernel cut alike
        return _own_groups(node, spec, ctx, src, px, "channels", px, group=channels // groups)
    if not _channel_split(px):
        return Result(REPLICATE, whole, conflict=f"grouped convolution on an input split as {px}, not on its "
                                                 f"channels (dim 1)")
    if groups % ctx.world_size:
        return Result(REPLICATE, whole, conflict=f"{groups} groups over channels split across {ctx.world_size} "
                                                 f"ranks: the world size must divide the groups")
    return _own_groups(node, spec, ctx, src, px, "channels")


def _own_groups(node: Node, spec: RuleSpec, ctx: RuleContext, src: Node, px: Shard, role: str,
                channels: Shard = Shard(1), group: int = 1) -> Result:
    """The rank's whole groups: input channels, weight and bias cut alike on dim 0 as `channels` lays out the
    output's, the group count local (over a zero-padded split or one in segments or pieces, the local channels
    over `group` channels a group: one group per local channel for a depthwise convolution, padding included)."""
    x, w, b = (undetached(_arg(node, spec.get(k))) for k in ("input", "weight", "bias"))
    sl = param_cut(moved(channels, 0), ctx.shape(src)[0])
    params: dict[Node, Optional[ParamSlice]] = {src: sl}
    if isinstance(b, Node) and ctx.param(b) is not None:
        params[b] = sl
    cut = moved(channels, 0)
    wants = [Want(x, px), Want(w, cut)] + ([Want(b, cut)] if isinstance(b, Node) else [])
    total = sum(channels.segments) if channels.segments else ctx.shape(x)[1] if channels.pieces else None
    local = ("split", spec.get("groups_arg"), None, None) if channels.plain else \
        ("set", spec.get("groups_arg"), dim_layout(channels, total, ctx.world_size).local_size(0) // group, None)
    return Result(channels, wants, role=role, params=params, localize=[local])


def _segmented_channels(p: Any) -> bool:
    """Channels (dim 1) split in segments, each over every rank (zero-padded each or not): q|k|v joined by a cat."""
    return isinstance(p, Shard) and p.dim == 1 and p.segments is not None and not p.seq and p.pieces is None \
        and p.outer is None and p.split_next is None and p.padded is None


def _pieced_channels(p: Any) -> bool:
    """Channels (dim 1) in fewer pieces than ranks, each held whole by the ranks sharing it: k of kv heads at 4 ranks."""
    return isinstance(p, Shard) and p.dim == 1 and p.pieces is not None and not p.seq and p.outer is None \
        and p.split_next is None


def _whole_groups(ctx: RuleContext, node: Node, spec: RuleSpec, px: Shard, channels: Any, groups: int) -> bool:
    """Every rank's block of every segment is whole groups of `channels // groups` channels, and the output has the
    input's channels (as many out as in per group), so the output is laid out as the input is."""
    if not isinstance(channels, int) or groups <= 1 or channels % groups:
        return False
    shape = ctx.shape(_arg(node, spec.get("weight")))
    out = None if shape is None else shape[1] * groups if _transposed(node, spec) else shape[0]
    size = channels // groups
    layout = dim_layout(px, channels, ctx.world_size)
    return out == channels and all(c % size == 0 for seg in layout.segments for c in (seg.size, *seg.cuts))
