"""Rule for convolutions with a weight parameter: split by channels, as a linear layer is by features.

A convolution fed a whole input is a column split: each rank computes its output channels (the
weight's dim 0 and the bias cut alike), so its output is split on the channel dim 1. One fed an
input split on its channels is a row split: each rank convolves its input channels (the weight's
dim 1) into a partial sum of every output channel, reduced once, the bias added after the
reduce. Whisper's two encoder convolutions are such a pair, with one all-reduce between them.
Grouped convolutions (depthwise, groups > 1) and computed weights are not split here (the DTensor
fallback may still place them).
"""
from __future__ import annotations

from typing import Any, Optional

from torch.fx import Node

from tpcompile.placement import PARTIAL, REPLICATE, ParamSlice, Replicate, Shard
from tpcompile.sharding_rules.registry import rule
from tpcompile.sharding_rules.rule_context import Result, RuleContext, Want
from tpcompile.sharding_rules.table import RuleSpec


def _arg(node: Node, i: Optional[int], default: Any = None) -> Any:
    return node.args[i] if i is not None and i < len(node.args) else default


@rule("weight_conv", args={"input": int, "weight": int, "bias": int, "groups_arg": int})
def weight_conv(node: Node, spec: RuleSpec, ctx: RuleContext) -> Result:
    """conv1d (any convolution whose channels are dim 1 of input and output): column split on a whole input,
    row split on one split by channels."""
    x, w, b = (_arg(node, spec.get(k)) for k in ("input", "weight", "bias"))
    tensors = [n for n in (x, w, b) if isinstance(n, Node)]
    if ctx.param(w) is None or _arg(node, spec.get("groups_arg"), 1) != 1:  # an activation weight, grouped
        whole = [Want(n, REPLICATE) for n in tensors]
        return Result(REPLICATE, whole, conflict=None if ctx.all_replicated(tensors) else
                      "convolution with a computed weight, or in groups, on a split input")
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
