"""Rules for reductions and normalisations, over a kept dim or over the split dim itself.

Over a dim the split keeps, the op runs on each rank's slice. Over the split dim, the result is
put together from each rank's partial statistics with one small collective (the rewrite is
passes/rewrite_stats.py): a sum or mean all-reduces the local result; a max, log-sum-exp,
vector norm or variance gathers the local ones (one value, or a mean and a sum of squares, per
row) and combines them; LayerNorm, RMSNorm and softmax gather two values per row (one for
RMSNorm) and normalise their own slice, which stays split. That replaces replicating the
projections that split the value; which of the two is chosen is decided by bytes: what the
statistics move per call at the captured shape against the bytes of weights the split saves
(`choose`). The choice is a note in the plan (`Plan.statistics`), or the reason for replicating.
"""
from __future__ import annotations

from typing import Any, Optional

from torch.fx import Node

from tpcompile.layouts import dim_layout
from tpcompile.placement import REPLICATE, Replicate, Shard, moved, split_dims
from tpcompile.sharding_rules.dtensor_fallback import example_numel, example_size
from tpcompile.sharding_rules.padded import zero_padded
from tpcompile.sharding_rules.registry import rule
from tpcompile.sharding_rules.rule_context import Result, RuleContext, Want, norm_dim
from tpcompile.sharding_rules.table import RuleSpec, op_name

COMBINES = ("sum", "mean", "max", "min", "logsumexp", "norm", "var", "std")
_SUMS = ("aten.add.Tensor", "aten.sub.Tensor", "aten.add_.Tensor", "aten.sub_.Tensor")


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def choose(node: Node, x: Node, ctx: RuleContext, values: int, what: str, result: Result) -> Result:
    """`result` (partial statistics) when that is the cheaper way, else a conflict that replicates the
    projections that split `x`, saying why.

    Partial statistics move `values` float32 numbers per row from each rank; replicating keeps whole
    the weights that split `x` (`ctx.split_bytes`). Statistics win when they move fewer bytes per
    call at the captured shape than the weights a split saves per rank, and the normalised value
    then meets at most one weight op (the row split that ends its region, as Megatron's blocks
    have): a value split across several weight ops would cost each of them an all-reduce.
    """
    p = ctx.placement(x)
    ws = ctx.world_size
    rows = example_numel(x) // max(1, example_size(x, p.dim))
    moved_bytes = rows * values * 4 * (ws - 1)
    saved = ctx.split_bytes(x) * (ws - 1) // ws
    reached = 1
    if p.seq:  # a token split: the alternative is gathering every token's features
        saved = example_numel(x) * 4 * (ws - 1) // ws
    else:
        reached = weight_ops_reached(node)
    why = None
    stream = None if p.seq else residual_add(x, ctx)
    if stream is not None:
        why = (f"the split value is a residual stream (the whole value {stream.name} plus a split branch), which "
               f"the split would carry on")
    elif reached > 1:
        why = (f"its result reaches {reached} weight ops, each of which would need an all-reduce of its "
               f"partial products")
    elif moved_bytes > saved:
        why = (f"partial statistics would move {_fmt(moved_bytes)} per call at the captured shape, more than the "
               f"{_fmt(saved)} per rank a split of the weights before it saves")
    if why:
        return Result(REPLICATE, [Want(w.node, REPLICATE) for w in result.wants],
                      conflict=f"{what} over the split dim {p.dim}: {why}")
    result.role = "stats"
    result.note = (f"{what} over the split dim {p.dim} from partial statistics: {values} value(s) per row from each "
                   f"rank, {_fmt(moved_bytes)} per call at the captured shape, instead of replicating the "
                   f"projections before it ({_fmt(saved)} more per rank)")
    return result


def residual_add(x: Node, ctx: RuleContext, limit: int = 16) -> Optional[Node]:
    """The whole operand of an add that made `x` split (a residual stream meeting a split branch), or None.

    Followed back from `x` through split values to the weight ops that split them.
    """
    todo, seen = [x], set()
    while todo and len(seen) < limit:
        n = todo.pop()
        if n in seen or not isinstance(ctx.placement(n), Shard):
            continue
        seen.add(n)
        spec = n.meta.get("tp_rule")
        if spec is None or spec.rule == "weight_matmul":
            continue
        inputs = [i for i in n.all_input_nodes if ctx.is_tensor(i)]
        if op_name(n.target) in _SUMS:
            whole = [i for i in inputs if isinstance(ctx.placement(i), Replicate) and ctx.requires_grad(i)
                     and ctx.shape(i) == ctx.shape(n)]
            if whole:
                return whole[0]
        todo.extend(inputs)
    return None


def weight_ops_reached(node: Node, limit: int = 64) -> int:
    """How many weight ops the value of `node` reaches as their input, through ops that are not weight ops."""
    seen, todo, found = {node}, list(node.users), set()
    while todo and len(seen) < limit:
        u = todo.pop()
        if u in seen:
            continue
        seen.add(u)
        spec = u.meta.get("tp_rule")
        if spec is not None and spec.rule == "weight_matmul" and _weight_of(u) not in seen:
            found.add(u)
            continue
        todo.extend(u.users)
    return len(found)


def _weight_of(node: Node) -> Any:
    spec = node.meta["tp_rule"]
    i = spec.get("weight")
    return node.args[i] if i is not None and i < len(node.args) else None


def _splittable(p: Any, world_size: int) -> bool:
    """A split whose ranks hold equal, distinct, unpadded parts (what partial statistics add up): no zeros past a
    rank's own cut, no segment in pieces shared by ranks (a fused q|k|v's kv heads fewer than the ranks)."""
    return isinstance(p, Shard) and p.padding is None and p.pieces is None and p.split_next is None \
        and (p.cuts is None or not p.rank_cuts and dim_layout(p, None, world_size).distinct)


def even_pieces(p: Any, world_size: int) -> bool:
    """One segment in equal pieces each shared by the same number of ranks, unpadded (heads fewer than the ranks)."""
    return isinstance(p, Shard) and p.in_pieces and p.pieces > 1 and world_size % p.pieces == 0


def reduced_dims(node: Node, spec: RuleSpec, nd: int) -> list[int]:
    """The dims a reduction row reduces over, non-negative (every dim when none are given)."""
    i = spec.get("dims_arg")
    dims = node.args[i] if i is not None and i < len(node.args) else node.kwargs.get("dim")
    if dims is None or (isinstance(dims, (list, tuple)) and not dims and spec.get("combine") in ("max", "min")):
        return list(range(nd))  # amax(x, []) reduces every dim
    return [norm_dim(d, nd) for d in ([dims] if isinstance(dims, int) else dims)]


def keepdim(node: Node, spec: RuleSpec) -> bool:
    """The keepdim argument of a reduction row."""
    k = spec.get("keepdim_arg")
    return bool(node.args[k] if k is not None and k < len(node.args) else node.kwargs.get("keepdim", False))


@rule("reduce", args={"dims_arg": int, "keepdim_arg": int, "keepdim_kwarg": str, "combine": COMBINES})
def reduce(node: Node, spec: RuleSpec, ctx: RuleContext) -> Result:
    """sum / mean / amax / var / norm ...: over kept dims on each slice; over the split dim from partial statistics."""
    x = node.args[0]
    p = ctx.placement(x)
    if isinstance(p, Replicate):
        return Result(REPLICATE, [Want(x, REPLICATE)])
    nd = len(ctx.shape(x))
    dims = reduced_dims(node, spec, nd)
    if p.split_next and p.dim + 1 in dims:
        return Result(REPLICATE, [Want(x, REPLICATE)], conflict=f"reduces over dim {p.dim + 1}, split within pieces")
    if p.dim not in dims:
        shift = 0 if keepdim(node, spec) else sum(d < p.dim for d in dims)
        return Result(moved(p, p.dim - shift), [Want(x, p)])
    why = _cannot(node, spec, ctx, p, dims)
    if why:
        return Result(REPLICATE, [Want(x, REPLICATE)], conflict=f"reduces over the sharded dim {p.dim}; {why}")
    values = 2 if spec.get("combine") in ("var", "std") else 1
    return choose(node, x, ctx, values, f"{spec.get('combine')} reduction", Result(REPLICATE, [Want(x, p)]))


def _cannot(node: Node, spec: RuleSpec, ctx: RuleContext, p: Shard, dims: list[int]) -> Optional[str]:
    """Why partial statistics cannot give this reduction, or None."""
    combine = spec.get("combine")
    if combine is None:
        return "no way to combine partial results of this op"
    if not _splittable(p, ctx.world_size):
        order = node.args[1] if len(node.args) > 1 else node.kwargs.get("ord", 2)
        adds = combine in ("sum", "mean") or (combine == "norm" and isinstance(order, (int, float)) and order > 0)
        if adds and p.plain_padded and zero_padded(node.args[0], ctx.placement):
            return None  # the padding holds zeros: the ranks' sums add up to the real one
        size = ctx.shape(node.args[0])[p.dim]
        if combine in ("sum", "mean") and p.rank_cuts and p.outer is None and isinstance(size, int) \
                and dim_layout(p, size, ctx.world_size).distinct:
            return None  # each rank's own cut of every segment (a kv group's heads), its padding zeroed first
        if combine in ("sum", "mean") and even_pieces(p, ctx.world_size):
            return None  # each piece summed once per rank sharing it: the sum divided by their count
        if combine in ("var", "std") and p.plain_padded and dims == [p.dim] == [len(ctx.shape(node.args[0])) - 1]:
            return None  # each rank's moments over its real entries, merged with their counts (padding left out)
        if combine in ("max", "min", "logsumexp") and p.plain_padded:
            return None  # the padding filled with what never wins (-inf for a max or a log-sum-exp)
        return f"the split {p} holds shared or padded parts"
    if combine in ("var", "std") and (dims != [p.dim] or not isinstance(ctx.shape(node.args[0])[p.dim], int)):
        return "a variance from partial statistics is combined over the split dim alone"
    if combine in ("var", "std") and p.seq and ctx.shape(node.args[0])[p.dim] % ctx.world_size:
        return (f"a variance over {ctx.shape(node.args[0])[p.dim]} tokens, which the {ctx.world_size} ranks hold in "
                f"shares of different sizes, is not merged from partial statistics")
    if combine == "norm":
        order = node.args[1] if len(node.args) > 1 else node.kwargs.get("ord", 2)
        if order == 0:
            return "a 0-norm counts entries; the counts of the slices are not its norm"
    return None


def _trailing(node: Node, spec: RuleSpec, ctx: RuleContext, x: Node) -> int:
    """How many trailing dims a norm normalises over."""
    return len(node.args[spec.get("shape_arg")])


@rule("norm", args={"shape_arg": int})
def norm(node: Node, spec: RuleSpec, ctx: RuleContext) -> Result:
    """layer_norm / rms_norm: over trailing dims that are not split; over the split last dim from partial statistics."""
    x = node.args[0]
    p = ctx.placement(x)
    extra = [a for a in node.args[2:4] if ctx.is_tensor(a)]
    if isinstance(p, Replicate):
        return Result(REPLICATE, [Want(n, REPLICATE) for n in [x] + extra])
    nd, k = len(ctx.shape(x)), _trailing(node, spec, ctx, x)
    if max(split_dims(p)) < nd - k:
        return Result(p, [Want(x, p)] + [ctx.replicated_want(n, p) for n in extra])
    rms = "rms_norm" in str(node.target)
    # over a zero-padded split: the padding adds nothing to the sums (divided by the real size); a LayerNorm's
    # padding is (0 - mean) / std, zero again only times the weight's zero padding
    weighted = len(node.args) > 2 and isinstance(node.args[2], Node)
    padded = k == 1 and p.plain_padded and (rms or weighted) and zero_padded(x, ctx.placement)
    if k != 1 or not (p.plain or padded) or not isinstance(ctx.shape(x)[-1], int):
        return Result(REPLICATE, [Want(n, REPLICATE) for n in [x] + extra],
                      conflict=f"normalises over the sharded dim {p.dim} (split as {p}, over {k} dims)")
    cut = Shard(0, cuts=p.cuts) if padded else Shard(0)
    wants = [Want(x, p)] + [Want(n, cut) for n in extra]  # this rank's slice of the weight and bias
    return choose(node, x, ctx, 1 if rms else 2, "RMSNorm" if rms else "LayerNorm", Result(p, wants))


@rule("softmax", args={"dim_arg": int})
def softmax(node: Node, spec: RuleSpec, ctx: RuleContext) -> Result:
    """softmax / log_softmax: along a kept dim on each slice; along the split dim from each rank's max and sum."""
    x = node.args[0]
    p = ctx.placement(x)
    if isinstance(p, Replicate):
        return Result(REPLICATE, [Want(x, REPLICATE)])
    dim = norm_dim(node.args[spec.get("dim_arg")], len(ctx.shape(x)))
    if dim not in split_dims(p):
        return Result(p, [Want(x, p)])
    if not _splittable(p, ctx.world_size) or p.segments is not None or p.outer is not None:
        return Result(REPLICATE, [Want(x, REPLICATE)], conflict=f"needs the whole of dim {dim}, split as {p}")
    return choose(node, x, ctx, 2, "softmax", Result(p, [Want(x, p)]))


@rule("group_norm", args={"groups_arg": int})
def group_norm(node: Node, spec: RuleSpec, ctx: RuleContext) -> Result:
    """group_norm: channels split into whole groups per rank (their count made local), or split on a batch-like dim."""
    x = node.args[0]
    p = ctx.placement(x)
    extra = [a for a in node.args[2:4] if ctx.is_tensor(a)]
    if isinstance(p, Replicate):
        return Result(REPLICATE, [Want(n, REPLICATE) for n in [x] + extra])
    groups = node.args[spec.get("groups_arg")]
    if p.dim == 0:
        return Result(p, [Want(x, p)] + [ctx.replicated_want(n, p) for n in extra])
    if p.dim != 1 or not p.plain or groups % ctx.world_size:
        return Result(REPLICATE, [Want(n, REPLICATE) for n in [x] + extra],
                      conflict=f"{groups} groups over channels split as {p}: the world size must divide the groups")
    return Result(p, [Want(x, p)] + [Want(n, Shard(0)) for n in extra],
                  localize=[("split", spec.get("groups_arg"), None, None)])
