"""Rules for ops that join several values into one: cat along a kept dim, stack along a new one."""
from __future__ import annotations

from torch.fx import Node

from tpcompile.placement import REPLICATE, Shard, moved, split_dims
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
        return Result(REPLICATE, [Want(t, REPLICATE) for t in tensors] + as_is,
                      conflict="cat of differently sharded values or along the sharded dim")
    return Result(target, [Want(t, target) for t in tensors] + as_is)


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
