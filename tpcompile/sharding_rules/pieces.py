"""Rule for a linear layer whose weight (or bias) is one row piece of a parameter (passes/param_pieces.py).

The piece is a weight of its own: a whole input makes it a column split by its own segments and
heads, an input split on the features a row split, exactly as `weight_matmul` does for a whole
parameter. What it asks of the parameter is the slice of all of it: cut along the rows per
segment of every piece (`ParamSlice(0, segments=...)`; nn.MultiheadAttention's cross-attention
`in_proj_weight` is q | k | v, so rank r holds q[r] | k[r] | v[r]), or along the input features for
a row split; every piece's linear asks the same, so the parameter gets one cut. A piece whose
segments the world size does not split into whole heads on every rank keeps the whole parameter
(its pieces' readers never hold pieces shared by several ranks). The roles that keep a weight whole by
design (routers, low-rank pairs: passes/weight_roles.py) are found on whole parameters only.
"""
from __future__ import annotations

from typing import Any, Optional

from torch.fx import Node

from tpcompile.placement import PARTIAL, REPLICATE, ParamSlice, Replicate, Shard, shard
from tpcompile.sharding_rules.rule_context import Result, RuleContext, Want, weight_view
from tpcompile.sharding_rules.table import RuleSpec


def _arg(node: Node, i: Optional[int]) -> Any:
    return node.args[i] if i is not None and i < len(node.args) else None


def _uneven(piece: Any, world_size: int) -> Optional[str]:
    """Why the parameter's pieces cannot all be split into whole heads on each of world_size ranks, or None."""
    for k, (segments, heads) in enumerate(piece.parts):
        sizes = list(heads or ()) + [None] * len(segments)  # each segment's head size, where known
        if any(s % (world_size * (d or 1)) for s, d in zip(segments, sizes)):
            return (f"piece {k} of {piece.param.target} (segments {segments}) does not split into whole heads on "
                    f"each of {world_size} ranks")
    return None


def piece_matmul(node: Node, spec: RuleSpec, ctx: RuleContext) -> Result:
    """F.linear with a weight or bias that is a row piece of a parameter: column or row split of the piece."""
    x, w, b = _arg(node, spec.get("input")), _arg(node, spec.get("weight")), _arg(node, spec.get("bias"))
    wp, bp = spec.get("weight_piece"), spec.get("bias_piece")
    wnode = wp.param if wp is not None else weight_view(w)[0]
    bnode = bp.param if bp is not None else (b if isinstance(b, Node) and ctx.param(b) is not None else None)
    if wnode is None or ctx.param(wnode) is None or (isinstance(b, Node) and bnode is None):
        return Result(REPLICATE, [Want(n, REPLICATE) for n in (x, w, b) if isinstance(n, Node)],
                      conflict=None if ctx.all_replicated([x]) else "linear with a computed weight on a split input")
    params: dict[Node, Optional[ParamSlice]] = {wnode: None, **({bnode: None} if bnode is not None else {})}
    whole = [Want(x, REPLICATE)]
    px, out_features = ctx.placement(x), int(ctx.shape(w)[0])
    if ctx.demoted(node):
        return Result(REPLICATE, whole, role="replicated", params=params)
    if isinstance(px, Replicate) or (isinstance(px, Shard) and px.seq):
        own = ctx.segment_hint(node) or (out_features,)
        why = next((u for u in (_uneven(p, ctx.world_size) for p in (wp, bp) if p) if u), None)
        if why is None and any(s % ctx.world_size for s in own):
            why = f"segments {tuple(own)} not divisible by world size {ctx.world_size}"
        if why:
            return Result(REPLICATE, whole, role="replicated", params=params, demote_self=why)
        out = shard(len(ctx.shape(node)) - 1, own)
        for n, p in ((wnode, wp), (bnode, bp)):
            if n is not None:
                params[n] = ParamSlice(0, p.segments if p is not None else out.segments)
        return Result(out, [ctx.replicated_want(x, out)], role="column", params=params)
    xshape = ctx.shape(x)
    if isinstance(px, Shard) and px.dim == len(xshape) - 1 and px.outer is None and px.pieces is None \
            and not px.shared(ctx.world_size):
        params[wnode] = ParamSlice(1, px.segments, cuts=px.cuts)
        out = PARTIAL if bnode is None and not ctx.sequence_parallel else ctx.reduced(node)
        bias = [ctx.replicated_want(b, out)] if isinstance(b, Node) else []
        return Result(out, [Want(x, px)] + bias, role="row", params=params)
    return Result(REPLICATE, whole, params=params, conflict=f"input is split as {px}, not on the contracted dim")
