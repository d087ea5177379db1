"""Rule for convolutions with a weight parameter: split by channels, as a linear layer is by features.

A convolution fed a whole input is a column split: each rank computes its output channels (the
weight's dim 0 and the bias cut alike), so its output is split on the channel dim 1. One fed an
input split on its channels is a row split: each rank convolves its input channels (the weight's
dim 1) into a partial sum of every output channel, reduced once, the bias added after the
reduce. Whisper's two encoder convolutions are such a pair, with one all-reduce between them.
A grouped convolution (depthwise: one group per channel, as Mamba's short causal convolution) on an
input split by channels into whole groups per rank convolves its own groups: the weight's dim 0
and the bias are cut alike, the output stays split on its channels and the group count is made
local, with no communication. Its weight may be a view of the parameter (`w.squeeze(1).unsqueeze(1)`).
"""
from __future__ import annotations

from typing import Any, Optional

from torch.fx import Node

from tpcompile.placement import PARTIAL, REPLICATE, ParamSlice, Replicate, Shard
from tpcompile.sharding_rules.registry import rule
from tpcompile.sharding_rules.rule_context import Result, RuleContext, Want, param_behind
from tpcompile.sharding_rules.table import RuleSpec


def _arg(node: Node, i: Optional[int], default: Any = None) -> Any:
    return node.args[i] if i is not None and i < len(node.args) else default


@rule("weight_conv", args={"input": int, "weight": int, "bias": int, "groups_arg": int})
def weight_conv(node: Node, spec: RuleSpec, ctx: RuleContext) -> Result:
    """conv1d (any convolution whose channels are dim 1 of input and output): column split on a whole input,
    row split on one split by channels."""
    x, w, b = (_arg(node, spec.get(k)) for k in ("input", "weight", "bias"))
    tensors = [n for n in (x, w, b) if isinstance(n, Node)]
    if _arg(node, spec.get("groups_arg"), 1) != 1:
        return _grouped(node, spec, ctx, tensors)
    if ctx.param(w) is None:  # an activation weight
        whole = [Want(n, REPLICATE) for n in tensors]
        return Result(REPLICATE, whole, conflict=None if ctx.all_replicated(tensors) else
                      "convolution with a computed weight on a split input")
    params: dict[Node, Optional[ParamSlice]] = {w: None, **({b: None} if isinstance(b, Node) else {})}
    px, channels = ctx.placement(x), ctx.shape(w)[0]
    if ctx.demoted(node):
        return Result(REPLICATE, [Want(x, REPLICATE)], role="replicated", params=params)
    if isinstance(px, Replicate):
        if channels % ctx.world_size:
            return Result(REPLICATE, [Want(x, REPLICATE)], role="replicated", params=params,
                          demote_self=f"{channels} output channels not divisible by world size {ctx.world_size}")
        params = {n: ParamSlice(0) for n in params}
        return Result(Shard(1), [ctx.replicated_want(x, Shard(1))], role="column", params=params)
    if isinstance(px, Shard) and px.plain and px.dim == 1 and not px.seq:
        params[w] = ParamSlice(1)
        out = PARTIAL if not isinstance(b, Node) and not ctx.sequence_parallel else REPLICATE
        bias = [ctx.replicated_want(b, out)] if isinstance(b, Node) else []
        return Result(out, [Want(x, px)] + bias, role="row", params=params)
    return Result(REPLICATE, [Want(x, REPLICATE)], params=params,
                  conflict=f"input is split as {px}, not on its channels (dim 1)")


def _grouped(node: Node, spec: RuleSpec, ctx: RuleContext, tensors: list) -> Result:
    """groups > 1: each rank convolves the whole groups of its input channels (weight and bias cut on dim 0)."""
    x, w, b = (_arg(node, spec.get(k)) for k in ("input", "weight", "bias"))
    whole = [Want(n, REPLICATE) for n in tensors]
    if ctx.all_replicated(tensors):
        return Result(REPLICATE, whole)
    found = param_behind(w, 0, depth=5)  # the parameter, its output channels still in dim 0
    src = found[0] if found is not None and found[1] == 0 and ctx.param(found[0]) is not None else None
    px, groups = ctx.placement(x), _arg(node, spec.get("groups_arg"))
    if isinstance(px, Replicate) or ctx.demoted(node):  # whole (a weight an earlier round cut is read whole)
        return Result(REPLICATE, whole, role="replicated", params={} if src is None else {src: None})
    if src is None:
        return Result(REPLICATE, whole, conflict="grouped convolution with a computed weight on a split input")
    if not (isinstance(px, Shard) and px.plain and px.dim == 1 and not px.seq):
        return Result(REPLICATE, whole, conflict=f"grouped convolution on an input split as {px}, not on its "
                                                 f"channels (dim 1)")
    if groups % ctx.world_size:
        return Result(REPLICATE, whole, conflict=f"{groups} groups over channels split across {ctx.world_size} "
                                                 f"ranks: the world size must divide the groups")
    params: dict[Node, Optional[ParamSlice]] = {src: ParamSlice(0)}
    if isinstance(b, Node) and ctx.param(b) is not None:
        params[b] = ParamSlice(0)
    wants = [Want(x, px), Want(w, Shard(0))] + ([Want(b, Shard(0))] if isinstance(b, Node) else [])
    return Result(Shard(1), wants, role="channels", params=params,
                  localize=[("split", spec.get("groups_arg"), None, None)])
