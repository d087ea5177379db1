"""view_as / reshape_as: a reshape to another value's shape, which that value, laid out as the result, gives each
rank locally (a gate viewed as the attention heads it multiplies, Beam's; RoFormer's rotary halves)."""
from __future__ import annotations

from torch.fx import Node

from tpcompile.placement import REPLICATE, Replicate, Shard
from tpcompile.sharding_rules.group_cuts import cuts_local
from tpcompile.sharding_rules.registry import rule
from tpcompile.sharding_rules.rule_context import Result, RuleContext, Want
from tpcompile.sharding_rules.shape import reshape_placement
from tpcompile.sharding_rules.table import RuleSpec


@rule("view_as")
def view_as(node: Node, spec: RuleSpec, ctx: RuleContext) -> Result:
    """x reshaped as `other`: the reshape's placement, when `other` is laid out so (or whole: cut locally)."""
    x, other = node.args[0], node.args[1]
    p, q = ctx.placement(x), ctx.placement(other)
    whole = [Want(x, REPLICATE), Want(other, REPLICATE)]
    if isinstance(p, Replicate):
        if isinstance(q, Replicate):
            return Result(REPLICATE, whole)
        return Result(REPLICATE, whole, conflict=f"whole value reshaped as {other.name}, which is split as {q}")
    out, why = reshape_placement(p, ctx.shape(x), ctx.shape(node), ctx.world_size)
    if out is not None and (out.split_next or out.rank_cuts and cuts_local(out, ctx.world_size) is None):
        out, why = None, f"reshape as {other.name} makes {out}, whose local sizes {other.name}'s shape may not give"
    if out is None:
        return Result(REPLICATE, whole, conflict=why)
    if not isinstance(q, Replicate) and q != out:
        pieced = [n for n, s in ((x, out), (other, q)) if isinstance(s, Shard) and s.pieces]  # one to a rank?
        return Result(REPLICATE, whole, unpiece=pieced or None,
                      conflict=f"reshape as {other.name}, which is laid out as {q}, not as the result's {out}")
    return Result(out, [Want(x, p), Want(other, out)])
