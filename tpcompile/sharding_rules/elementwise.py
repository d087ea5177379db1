"""Rules for elementwise ops (reductions and normalisations are in reductions.py)."""
from __future__ import annotations

from typing import Any

from torch.fx import Node

from tpcompile.placement import REPLICATE, Replicate, Shard, moved, split_dims
from tpcompile.sharding_rules.group_cuts import cuts_local
from tpcompile.sharding_rules.registry import rule
from tpcompile.sharding_rules.rule_context import Result, RuleContext, Want, norm_dim, sizes_equal
from tpcompile.sharding_rules.shared_pieces import cut_from_shared
from tpcompile.sharding_rules.table import RuleSpec


def _tensor_args(node: Node, ctx: RuleContext) -> list[Node]:
    flat: list[Any] = []
    for a in list(node.args) + list(node.kwargs.values()):
        flat.extend(a if isinstance(a, (list, tuple)) else [a])
    return [a for a in flat if ctx.is_tensor(a)]


@rule("pointwise", listed=True)
def pointwise(node: Node, spec: RuleSpec, ctx: RuleContext) -> Result:
    """Elementwise with broadcasting: replicated operands are sliced, or broadcast and grad-synced."""
    inputs = _tensor_args(node, ctx)
    if ctx.all_replicated(inputs):
        return Result(REPLICATE, [Want(n, REPLICATE) for n in inputs])
    nout = len(ctx.shape(node))
    targets = set()
    for n in inputs:
        p = ctx.placement(n)
        if isinstance(p, Shard):
            targets.add(moved(p, p.dim + nout - len(ctx.shape(n))))
    # operands in shared pieces are cut locally to an even (or zero-padded) split's blocks, or to finer pieces
    even = [t for t in targets if all(o == t or cut_from_shared(o, t, ctx.world_size) for o in targets)]
    if len(targets) > 1 and len(even) != 1:
        pieced = [n for n in inputs if isinstance(ctx.placement(n), Shard) and ctx.placement(n).pieces]
        return Result(REPLICATE, [Want(n, REPLICATE) for n in inputs], unpiece=pieced or None,
                      conflict=f"operands sharded differently ({', '.join(map(str, targets))})")
    target = even[0] if len(targets) > 1 else targets.pop()
    wants = []
    for n in inputs:
        p, shape = ctx.placement(n), ctx.shape(n)
        if isinstance(p, Shard):
            wants.append(Want(n, moved(target, p.dim)))  # itself, or the even blocks cut from its pieces
            continue
        d = target.dim - (nout - len(shape))
        if d >= 0 and shape[d] != 1:
            wants.append(Want(n, moved(target, d)))
        else:
            wants.append(ctx.replicated_want(n, target))
    return Result(target, wants)


@rule("pointwise_inplace", listed=True)
def pointwise_inplace(node: Node, spec: RuleSpec, ctx: RuleContext) -> Result:
    """add_ / mul_ / relu_ ...: as their out-of-place twins, when the result keeps the written input's placement."""
    res = pointwise(node, spec, ctx)
    target = node.args[0]
    if res.conflict is None and ctx.is_tensor(target) and ctx.placement(target) != res.out:
        return Result(REPLICATE, [Want(n, REPLICATE) for n in _tensor_args(node, ctx)],
                      conflict=f"writes a {res.out} result into {target.name} in place, which is {ctx.placement(target)}")
    return res


def _whole_dims(node: Node, ctx: RuleContext, reads, why) -> Result:
    """x kept as it is unless a split dim is one of those the op reads whole (`reads(ndim)`): then whole, the
    conflict worded by `why(placement, dims read whole)`."""
    x = node.args[0]
    p = ctx.placement(x)
    if isinstance(p, Replicate):
        return Result(REPLICATE, [Want(x, REPLICATE)])
    whole = reads(len(ctx.shape(x)))
    if any(d in whole for d in split_dims(p)):
        return Result(REPLICATE, [Want(x, REPLICATE)], conflict=why(p, sorted(whole)))
    return Result(p, [Want(x, p)])


@rule("along_dim", args={"dim_arg": int})
def along_dim(node: Node, spec: RuleSpec, ctx: RuleContext) -> Result:
    """softmax / cumsum along one dim: fine unless that dim is the sharded one."""
    return _whole_dims(node, ctx, lambda ndim: {norm_dim(node.args[spec.get("dim_arg")], ndim)},
                       lambda p, dims: f"needs the whole of dim {dims[0]}, which is sharded")


@rule("last_dims", args={"count": int})
def last_dims(node: Node, spec: RuleSpec, ctx: RuleContext) -> Result:
    """tril / triu: one matrix op per entry of the leading dims; fine unless a split dim is one of the last `count`."""
    n = spec.get("count")
    return _whole_dims(node, ctx, lambda ndim: set(range(ndim - n, ndim)),
                       lambda p, dims: f"acts on the last {n} dims as a whole, and {p} splits one of them")


@rule("new_sized", args={"shape_arg": int})
def new_sized(node: Node, spec: RuleSpec, ctx: RuleContext) -> Result:
    """x.new_empty(size) / new_zeros / new_ones / new_full: a fresh tensor whose size keeps x's split dim (the
    same position, the same size: `x.new_empty(*x.shape[:-1], n)`, filled by slices later) is split like x,
    its size literal per rank (zero-padded like x, in pieces shared by ranks or cut within kv groups, when x is);
    any other fresh tensor is whole."""
    x, i = node.args[0], spec.get("shape_arg")
    p, sizes = ctx.placement(x), list(node.args[i]) if i < len(node.args) else []
    xs = ctx.shape(x)
    if isinstance(p, Shard) and len(sizes) == len(xs) and p.dim < len(xs) and not p.seq and p.outer is None \
            and p.split_next is None and sizes_equal(ctx.shape(node)[p.dim], xs[p.dim]):
        if p.plain or p.plain_padded or p.in_pieces:  # (heads in pieces
            return Result(p, [Want(x, p)], localize=[("shape", i, p.dim, p.pieces)])  # fewer than the ranks)
        local = cuts_local(p, ctx.world_size) if p.rank_cuts else None  # heads cut within their kv groups
        if local is not None:
            return Result(p, [Want(x, p)], localize=[("shape_set", i, (p.dim, local), None)])
    return Result(REPLICATE, [Want(x, p)])


@rule("no_output", listed=True)
def no_output(node: Node, spec: RuleSpec, ctx: RuleContext) -> Result:
    """Metadata assertions: no tensor out, inputs taken as they are."""
    return Result(None, [Want(n, ctx.placement(n)) for n in _tensor_args(node, ctx)])
