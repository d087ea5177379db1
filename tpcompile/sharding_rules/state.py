"""Rules for writes into state: in-place updates of a buffer (a KV cache filled by index_copy_).

A split value written into a buffer makes the buffer split the same way: each rank keeps only
its part (its heads of a KV cache), and reads of the buffer see it split. The buffer is cut
like a weight is cut by its weight op (the write requests a ParamSlice), so it is sliced in
every rank module, counted in the plan, and loaded and saved per rank.
"""
from __future__ import annotations

from dataclasses import replace

from torch.fx import Node

from tpcompile.placement import REPLICATE, ParamSlice, Shard
from tpcompile.sharding_rules.registry import rule
from tpcompile.sharding_rules.rule_context import Result, RuleContext, Want, norm_dim
from tpcompile.sharding_rules.table import RuleSpec


def _fail(node: Node, tensors: list, why: str) -> Result:
    return Result(REPLICATE, [Want(n, REPLICATE) for n in tensors], conflict=why)


@rule("write_into", args={"src": int, "dim_arg": int})
def write_into(node: Node, spec: RuleSpec, ctx: RuleContext) -> Result:
    """index_copy_ / index_put_ / copy_: the destination keeps the written value's split; a buffer is cut for it."""
    dst, src = node.args[0], node.args[spec.get("src")]
    tensors = [a for a in node.args if ctx.is_tensor(a)]
    tensors += [i for a in node.args if isinstance(a, (list, tuple)) for i in a if ctx.is_tensor(i)]
    if ctx.all_replicated(tensors):
        return Result(REPLICATE, [Want(n, REPLICATE) for n in tensors])
    ps, pd = ctx.placement(src), ctx.placement(dst)
    dshape, sshape = ctx.shape(dst), ctx.shape(src)
    if not isinstance(ps, Shard) or ps.segments or ps.padded or ps.outer or ps.seq or len(sshape) != len(dshape):
        return _fail(node, tensors, f"writes a value split as {ps} into {dst.name} in place")
    i = spec.get("dim_arg")
    if i is not None and norm_dim(node.args[i], len(dshape)) == ps.dim:
        return _fail(node, tensors, f"writes along the split dim {ps.dim} of {dst.name}")
    target = replace(ps, split_next=None)
    buffer = dst.op == "get_attr" and ctx.buffer(dst) is not None
    if not buffer and pd != target:
        return _fail(node, tensors, f"writes a {target} value into {dst.name} in place, which is {pd}")
    params = {dst: ParamSlice(target.dim, None, None, target.pieces)} if buffer and not ctx.demoted(node) else {}
    if buffer and not params:
        return _fail(node, tensors, f"writes into buffer {dst.target}, which the plan keeps whole")
    wants = [Want(dst, target), Want(src, ps)]
    wants += [Want(n, REPLICATE) for n in tensors if n not in (dst, src)]  # indices, positions
    return Result(target, wants, params=params)
