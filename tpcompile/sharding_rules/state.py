"""Rules for writes into state: in-place updates of a buffer (a KV cache filled by index_copy_).

A split value written into a buffer makes the buffer split the same way: each rank keeps only
its part (its heads of a KV cache), and reads of the buffer see it split. The buffer is cut
like a weight is cut by its weight op (the write requests a ParamSlice), so it is sliced in
every rank module, counted in the plan, and loaded and saved per rank.

The destination may also be a view of the buffer that keeps its rank (`cache[:B]`, a batch
smaller than the one the cache was allocated for): the buffer under the view is cut, and once
the next round reads the buffer split, the view is split like the value written.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from torch.fx import Node

from tpcompile.placement import REPLICATE, Shard, param_cut
from tpcompile.sharding_rules.registry import rule
from tpcompile.sharding_rules.rule_context import Result, RuleContext, Want, norm_dim
from tpcompile.sharding_rules.table import RuleSpec, op_name


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
    if isinstance(pd, Shard) and (pd.plain or pd.plain_padded or pd.in_pieces) and not pd.seq \
            and ctx.all_replicated([n for n in tensors if n is not dst]) \
            and len(sshape) == len(dshape) and sshape[pd.dim] == dshape[pd.dim] and _buffer_under(dst, -1, ctx) is None:
        # a whole value written into a split temporary (`out[..., :n].copy_(whole)`): each rank writes its part
        # (of the padded heads, zeros past the real ones)
        return Result(pd, [Want(dst, pd), Want(src, pd)] + [Want(n, REPLICATE) for n in tensors if n not in (dst, src)])
    others = [n for n in tensors if n not in (dst, src)]  # indices, positions
    if isinstance(ps, Shard) and pd == ps and not ps.seq and len(sshape) == len(dshape) \
            and _buffer_under(dst, -1, ctx) is None and ctx.all_replicated(others) \
            and not _along(node, spec, len(dshape), ps.dim):
        # a temporary laid out as the value written (segments, heads cut within their groups): each rank writes its
        # part into its part
        return Result(ps, [Want(dst, ps), Want(src, ps)] + [Want(n, REPLICATE) for n in others])
    # (heads zero-padded to a multiple of the ranks: the buffer is padded too)
    if not isinstance(ps, Shard) or ps.segments and not ps.pieces or (ps.padded and not ps.plain_padded) \
            or ps.outer or ps.seq or len(sshape) != len(dshape):
        return _fail(node, tensors, f"writes a value split as {ps} into {dst.name} in place")
    i = spec.get("dim_arg")
    if i is not None and norm_dim(node.args[i], len(dshape)) == ps.dim:
        return _fail(node, tensors, f"writes along the split dim {ps.dim} of {dst.name}")
    target = replace(ps, within=None)
    root = _buffer_under(dst, target.dim, ctx)
    if root is None and pd != target:
        return _fail(node, tensors, f"writes a {target} value into {dst.name} in place, which is {pd}")
    if root is not None and root is not dst and pd != target and ctx.placement(root) == target:
        return _fail(node, tensors, f"writes a {target} value into {dst.name} (a view of {root.target}), "
                                    f"which is {pd}")
    # a view whose buffer is not cut yet: this round cuts it, the next reads it cut (the view then matches)
    cut = root is not None and not ctx.demoted(node)
    params = {root: param_cut(target, ctx.shape(root)[target.dim])} if cut else {}
    if root is not None and not params:
        return _fail(node, tensors, f"writes into buffer {root.target}, which the plan keeps whole")
    # (a view of a buffer this round has yet to cut is taken as it is: the round is not the last)
    wants = [Want(dst, target if root is None or root is dst or ctx.placement(root) == target else pd), Want(src, ps)]
    wants += [Want(n, REPLICATE) for n in tensors if n not in (dst, src)]  # indices, positions
    return Result(target, wants, params=params)


def _along(node: Node, spec: RuleSpec, nd: int, dim: int) -> bool:
    """True when the write indexes along `dim` (index_copy_'s dim)."""
    i = spec.get("dim_arg")
    return i is not None and i < len(node.args) and norm_dim(node.args[i], nd) == dim


_VIEWS = ("aten.slice.Tensor", "aten.narrow.default", "aten.alias.default")


def _buffer_under(dst: Node, split_dim: int, ctx: RuleContext) -> Optional[Node]:
    """The buffer's get_attr node when `dst` is a buffer or a same-rank view of one not cut along `split_dim`."""
    node = dst
    for _ in range(8):
        if node.op == "get_attr":
            return node if ctx.buffer(node) is not None else None
        if node.op != "call_function" or op_name(node.target) not in _VIEWS or not isinstance(node.args[0], Node):
            return None
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        if op_name(node.target) != "aten.alias.default" and norm_dim(dim, len(ctx.shape(node))) == split_dim:
            return None
        node = node.args[0]
    return None
