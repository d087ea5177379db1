"""Rules for the ops that hold the weights: matmuls with a weight, embeddings, attention."""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from torch.fx import Node

from tpcompile.layouts import even_cuts, holders, same_holdings
from tpcompile.placement import (PARTIAL, REPLICATE, Replicate, Shard, moved, pad_cuts, padded_size, param_cut,
                                 piece_shard, segmented)
from tpcompile.sharding_rules.gqa import gqa_attention
from tpcompile.sharding_rules.group_cuts import group_cuts
from tpcompile.sharding_rules.pieces import piece_matmul
from tpcompile.sharding_rules.registry import rule
from tpcompile.sharding_rules.rule_context import Choice, ParamSlice, Result, RuleContext, Want, undetached, weight_view
from tpcompile.sharding_rules.shared_pieces import cut_from_shared, same_pieces, whole_piece
from tpcompile.sharding_rules.table import RuleSpec


def _arg(node: Node, i: Optional[int]) -> Any:
    return node.args[i] if i is not None and i < len(node.args) else None


@rule("weight_matmul", args={"input": int, "weight": int, "bias": int,
                             "weight_layout": ("out_in", "in_out")})  # out_in: F.linear, in_out: x @ W
def weight_matmul(node: Node, spec: RuleSpec, ctx: RuleContext) -> Result:
    """linear / addmm / mm / matmul: column split on a replicated input, row split on a sharded one."""
    if spec.get("weight_piece") is not None or spec.get("bias_piece") is not None:
        return piece_matmul(node, spec, ctx)  # a row piece of a parameter as its weight (sharding_rules/pieces.py)
    x, b = _arg(node, spec.get("input")), undetached(_arg(node, spec.get("bias")))  # read detached: grad-off regions
    w, transposed = weight_view(_arg(node, spec.get("weight")))  # W, or W.t() read as W the other way round
    wshape = ctx.shape(w)
    if ctx.param(w) is None or wshape is None or len(wshape) != 2:
        return activation_matmul(node, spec, ctx)
    out_in = (spec.get("weight_layout") == "out_in") != transposed
    out_dim, in_dim = (0, 1) if out_in else (1, 0)
    px = ctx.placement(x)
    xshape = ctx.shape(x)
    params: dict[Node, Optional[ParamSlice]] = {w: None}
    if isinstance(b, Node):
        params[b] = None
    if ctx.demoted(node):
        return Result(REPLICATE, [Want(x, REPLICATE)], role="replicated", params=params)
    if isinstance(px, Replicate) or (isinstance(px, Shard) and px.seq):
        grouped = spec.get("kv_groups") and not ctx.pieces_of(node)  # (kv heads, ranks sharing one, head size)
        why = _keep_whole(spec) or (f"{wshape[out_dim]} output feature(s), fewer than the {ctx.world_size} ranks: "
                                    f"whole on every rank" if wshape[out_dim] < ctx.world_size and not grouped
                                    else None)
        if why:
            return Result(REPLICATE, [Want(x, REPLICATE)], role="replicated", params=params, note=why)
        if grouped:  # each rank its entries of each group (one a head of a step size: fewer than the ranks)
            return _group_cut(node, spec, ctx, x, w, b, out_dim, params)
        segments = ctx.segment_hint(node) or (wshape[out_dim],)
        counts = head_pieces(segments, spec.get("heads"), ctx.world_size) if not spec.get("unit") \
            else [ctx.world_size] * len(segments)
        heads = spec.get("heads")
        units = [_unit(s, heads[i] if heads and i < len(heads) else None) if g == ctx.world_size else 1
                 for i, (s, g) in enumerate(zip(segments, counts))]
        if ctx.unpieced(node) and not ctx.pieces_of(node):  # heads one to a rank, zero-padded, not in pieces
            units = [s // g if 1 < g < ctx.world_size else u for s, g, u in zip(segments, counts, units)]
            counts = [g if g == 1 else ctx.world_size for g in counts]  # (one head whole on every rank stays so)
        unit = spec.get("unit")  # heads padded by whole kv groups (passes/head_groups.py), per segment if fused
        if unit and len(segments) == (len(unit) if isinstance(unit, tuple) else 1):
            units = [_unit(s, u) for s, u in zip(segments, unit if isinstance(unit, tuple) else (unit,))]
        bad = [s for s, g, u in zip(segments, counts, units) if s % (g * u)]  # each rank keeps whole heads
        pads = None
        if bad:  # zero-padded to a multiple of the world size (each segment to its own; segments in fewer
            # pieces than ranks, multi-query's one kv head, as they are); fine up to a row split or the output
            pads = [padded_size(s, ctx.world_size * u) if g == ctx.world_size else s
                    for s, u, g in zip(segments, units, counts)]
        pieces = ctx.pieces_of(node) or (counts[0] if len(segments) == 1 and counts[0] < ctx.world_size else None)
        out = piece_shard(len(ctx.shape(node)) - 1, wshape[out_dim], pieces) if pieces else \
            segmented(len(ctx.shape(node)) - 1, segments, ctx.world_size, pads, counts)  # (pieces: fewer than
        # the ranks, each held by several ranks; MQA's one kv head: by all)
        params[w] = param_cut(moved(out, out_dim), wshape[out_dim])
        if isinstance(b, Node):
            params[b] = param_cut(moved(out, 0), wshape[out_dim])
        return Result(out, [ctx.replicated_want(x, out)], role="column", params=params)
    if isinstance(px, Shard) and px.pieces is not None:
        # pieces shared by several ranks would be summed once per sharing rank (2 query heads at 4 ranks): asks
        # for them one to a rank, zero-padded (propagate's unpiece), before replicating
        return Result(REPLICATE, [Want(x, REPLICATE)], params=params, unpiece=[x],
                      conflict=f"input holds {px.pieces} pieces shared among {ctx.world_size} ranks; a row "
                               f"split would count each piece {holders(ctx.world_size, px.pieces)} times")
    if isinstance(px, Shard) and px.dim == len(xshape) - 1 and px.outer is None:
        params[w] = ParamSlice(in_dim, px.segments, cuts=px.cuts)
        # without a bias the sum stays pending until an op needs it whole (experts summed, then reduced once)
        out = PARTIAL if not isinstance(b, Node) and not ctx.sequence_parallel else ctx.reduced(node)
        # the bias is added once, after the reduce; on token-split output its gradient is partial
        bias = [ctx.replicated_want(b, out)] if isinstance(b, Node) else []
        return Result(out, [Want(x, px)] + bias, role="row", params=params)
    if _batch_split(px, xshape, b, ctx.world_size):
        # split on a dim the weight does not touch (heads of `states @ W`): each rank applies the whole weight
        # to its rows; the weight's gradient is a summand on each rank, summed over them
        return Result(px, [Want(x, px), ctx.replicated_want(w, px)], params=params,
                      note="whole weight applied to the rank's rows of an input split on a leading dim")
    return Result(REPLICATE, [Want(x, REPLICATE)], params=params,
                  conflict=f"input is sharded on dim {px.dim}, not on the contracted dim")


def _group_cut(node: Node, spec: RuleSpec, ctx: RuleContext, x: Node, w: Node, b: Any, out_dim: int,
               params: dict) -> Result:
    """A query projection whose kv groups are split within the ranks sharing each kv head (`group_cuts.py`); a fused
    q|k|v projection's k and v segments in kv pieces, each held by the ranks sharing it. `grouped`: the fused
    segments cut by groups (the query's, 0, unless passes/head_repeats.py says otherwise: a linear attention's
    value heads, its query and key heads repeated for them)."""
    kv, share, head = spec.get("kv_groups")
    fused = ctx.segment_hint(node)
    grouped = spec.get("grouped")
    whole = ctx.shape(w)[out_dim]
    fused = fused if fused and (grouped is not None or len(fused) == 3) and sum(fused) == whole else (whole,)
    grouped = grouped or (0,)
    segments: tuple = ()
    cuts: tuple = ()
    for i, s in enumerate(fused):  # each grouped segment: kv segments of one group's features, cut among its ranks
        n = kv if i in grouped else 1
        segments += (s // n,) * n
        cuts += group_cuts(kv, s // kv, head, share, ctx.world_size) if i in grouped else (even_cuts(s, kv),)
    cut = ParamSlice(out_dim, segments, cuts=cuts)
    params[w] = cut
    if isinstance(b, Node):
        params[b] = replace(cut, dim=0)
    out = Shard(len(ctx.shape(node)) - 1, cut.segments, cuts=cut.cuts)
    return Result(out, [ctx.replicated_want(x, out)], role="column", params=params)


def _runs_of_heads(p: Shard, ctx: RuleContext) -> bool:
    """Heads in segments, each split among all the ranks (DiffLlama's two halves, passes/head_runs.py)."""
    return p.segments is not None and p.outer is None and p.pieces is None and not p.seq \
        and not p.fewer(ctx.world_size)


def _batch_split(px: Any, xshape: Any, bias: Any, world_size: int) -> bool:
    """An input split on a leading dim of x @ W, each rank rows of its own (plainly, in segments, or cut per rank:
    heads cut within kv groups), zero-padded only when no bias makes the padding non-zero."""
    if not isinstance(px, Shard) or xshape is None or px.dim >= len(xshape) - 1 or px.seq or px.pieces is not None \
            or px.outer is not None or px.fewer(world_size):
        return False
    padded = px.padded is not None or px.cuts is not None and any(c[-1] != s for s, c in zip(px.segments, px.cuts))
    return not padded or not isinstance(bias, Node)


def _unit(size: int, d: Optional[int]) -> int:
    """The unit a split of `size` features must not cut: its head size d when a reshape splits it into heads, else 1."""
    return d if d and size % d == 0 else 1


def head_pieces(segments: tuple, heads: Optional[tuple], world_size: int) -> list[int]:
    """Per segment, how many pieces it is cut into: the world size, or its head count when that is fewer than
    the ranks and divides them (kv heads of a fused q|k|v; 1 for multi-query attention, whole on every rank)."""
    out = []
    for i, s in enumerate(segments):
        d = heads[i] if heads and i < len(heads) else None
        n = s // d if d and s % d == 0 else None
        out.append(n if n and n < world_size and world_size % n == 0 else world_size)
    return out


def _keep_whole(spec: RuleSpec) -> Optional[str]:
    """Why a low-rank projection with a whole input stays whole (annotate pairs them), or None."""
    if spec.get("router"):
        return "router: whole on every rank (its top-k choice needs every expert's score)"
    if spec.get("embedding_projection"):
        return "embedding projection: whole on every rank (its output is the residual stream the layers read whole)"
    if spec.get("low_rank") == "narrow":
        return "narrow projection: whole on every rank (a narrow value, or coefficients from it that weight others)"
    if spec.get("low_rank") == "down":
        return "low-rank down-projection: whole on every rank (its up-projection is split instead)"
    partner = spec.get("low_rank_from")
    layout = partner.meta.get("tp_layout") if partner is not None else None
    if layout is not None and layout.role == "row":
        return "low-rank up-projection after a row split: its input is whole after the reduce, and so is its output"
    return None


@rule("matmul")
def activation_matmul(node: Node, spec: RuleSpec, ctx: RuleContext) -> Result:
    """matmul / bmm of two activations: a sharded batch, row or column dim carries through."""
    a, b = node.args[0], node.args[1]
    operands = [(a, ctx.shape(a), True), (b, ctx.shape(b), False)]
    nout = len(ctx.shape(node))
    everything_replicated = [Want(a, REPLICATE), Want(b, REPLICATE)]
    if ctx.all_replicated([a, b]):
        return Result(REPLICATE, everything_replicated)
    if min(len(operands[0][1]), len(operands[1][1])) < 2:
        return Result(REPLICATE, everything_replicated, conflict="1-D matmul of a sharded value")
    target: Optional[Shard] = None
    for n, shape, is_a in operands:
        p = ctx.placement(n)
        if not isinstance(p, Shard):
            continue
        d = _out_dim(p.dim, len(shape), nout, is_a)
        if d is None or (p.split_next and _out_dim(p.dim + 1, len(shape), nout, is_a) is None):
            return Result(REPLICATE, everything_replicated, conflict="sharded along the contracted dim")
        if target is not None and target != moved(p, d):
            return Result(REPLICATE, everything_replicated, conflict="operands sharded differently")
        target = moved(p, d)
    wants = []
    for n, shape, is_a in operands:
        p = ctx.placement(n)
        if isinstance(p, Shard):
            wants.append(Want(n, p))
            continue
        d = target.dim - (nout - len(shape))
        if d >= 0 and _out_dim(d, len(shape), nout, is_a) == target.dim and shape[d] != 1:
            wants.append(Want(n, moved(target, d)))
        else:
            wants.append(ctx.replicated_want(n, target))
    return Result(target, wants)


def _out_dim(d: int, ndim: int, nout: int, is_a: bool) -> Optional[int]:
    """Where operand dim `d` lands in the matmul output; None for the contracted dim."""
    if (is_a and d == ndim - 1) or (not is_a and d == ndim - 2):
        return None
    return d + nout - ndim


@rule("embedding")
def embedding(node: Node, spec: RuleSpec, ctx: RuleContext) -> Result:
    """Embedding lookup: split by rows (vocabulary), each rank's rows looked up, the sum left pending.

    The user's token ids split their table by vocabulary. A table read with other indices (positions, token
    types) is split the same way: its pending sum is added to the token embeddings' before the one all-reduce
    (passes/pending_sums.py keeps it whole where its sum would need an all-reduce of its own). Under sequence
    parallelism a lookup is reduce-scattered at once, so only the token ids' table is split.
    """
    w, idx = node.args[0], node.args[1]
    wshape = ctx.shape(w)
    params: dict[Node, Optional[ParamSlice]] = {w: None}
    if not isinstance(ctx.placement(idx), Replicate):
        return Result(REPLICATE, [Want(idx, REPLICATE)], params=params, conflict="indices are sharded")
    if ctx.param(w) is None or ctx.demoted(node) or not (ctx.is_user_input(idx) or not ctx.sequence_parallel):
        return Result(REPLICATE, [Want(idx, REPLICATE)], role="replicated", params=params)
    padded = padded_size(wshape[0], ctx.world_size) if wshape[0] % ctx.world_size else None
    params[w] = ParamSlice(0, cuts=None if padded is None else pad_cuts(padded, ctx.world_size))
    out = ctx.reduced(node) if ctx.sequence_parallel else PARTIAL
    return Result(out, [Want(idx, REPLICATE)], role="vocab", params=params)


@rule("sdpa")
def sdpa(node: Node, spec: RuleSpec, ctx: RuleContext) -> Result:
    """scaled_dot_product_attention: whole heads (dim 1) per rank."""
    q, k, v = node.args[:3]
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    tensors = [q, k, v] + ([mask] if isinstance(mask, Node) else [])
    if ctx.all_replicated(tensors):
        return Result(REPLICATE, [Want(n, REPLICATE) for n in tensors])
    gqa = gqa_attention(node, ctx, q, k, v, mask)  # fewer kv heads than query heads, read by the op itself
    if gqa is not None:
        return gqa
    one = [n for n in (k, v) if ctx.shape(n)[1] == 1 and (ctx.placement(n) == REPLICATE
                                                            or whole_piece(ctx.placement(n), 1))]
    # whole heads per rank; heads zero-padded to a multiple of the ranks when their count does not divide
    # (the query's layout leads: keys and values laid out otherwise are blamed, so they are the ones kept whole)
    target = next((p for n in (q, k, v) if n not in one and isinstance(p := ctx.placement(n), Shard)
                   and p.dim == 1 and (p.plain or p.plain_padded or p.rank_cuts or _runs_of_heads(p, ctx))), None)
    # whole on every rank (one kv head repeated, `whole_piece`): cut locally to any pieces
    if target is None:  # heads fewer than the ranks, q, k and v alike in pieces: each piece's ranks compute it
        held = [ctx.placement(n) for n in (q, k, v) if n not in one and not whole_piece(ctx.placement(n), 1)]
        one_way = held[0] if held and all(same_pieces(h, held[0]) for h in held) else None
        target = one_way if isinstance(one_way, Shard) and one_way.dim == 1 and one_way.in_pieces \
            and one_way.pieces > 1 else Shard(1)
    def alike(n: Node) -> bool:  # the target's heads, written otherwise (a repeat's copies, a reshape's outer)
        p = ctx.placement(n)
        return isinstance(p, Shard) and p != target and p.dim == 1 \
            and same_holdings(p, target, ctx.shape(n)[1], ctx.world_size)

    for n in (k, v, mask, q):
        p = ctx.placement(n) if isinstance(n, Node) else None
        shared = whole_piece(p, 1) and cut_from_shared(p, target, ctx.world_size)  # whole on every rank: its part
        if isinstance(p, Shard) and not same_pieces(p, target) and n not in one and not shared and not alike(n):
            why = f"attention input sharded as {p}, expected whole heads (dim 1)"
            if n in (k, v) and p.dim == 1 and (p.plain_padded or p.pieces) and target.dim == 1 \
                    and (target.plain_padded or isinstance(ctx.placement(q), Shard)):
                why = Choice(f"the key/value heads, laid out as {p} over {ctx.world_size} ranks, do not line up with "
                             f"the query heads ({target}): keys and values whole on every rank (kv-head "
                             f"replication), each rank reading the ones its query heads use")
            # query heads in pieces shared by ranks, keys and values one to a rank: asks for the query's so too
            unpiece = [n] if n is q and p.pieces and target.pieces is None else None
            return Result(REPLICATE, [Want(n, REPLICATE) for n in tensors], blame=[n], conflict=why, unpiece=unpiece)
    wants = []
    for n in (q, k, v):
        heads = ctx.shape(n)[1]
        if n in one:  # one key / value head broadcast over every query head (multi-query): whole on each rank
            wants.append(Want(n, ctx.placement(n)) if ctx.placement(n) != REPLICATE else ctx.replicated_want(n, target))
            continue
        whole = isinstance(ctx.placement(n), Replicate) or whole_piece(ctx.placement(n), 1)
        if whole and heads % ctx.world_size and target.padded != padded_size(heads, ctx.world_size) \
                and not (target.in_pieces and heads % target.pieces == 0):
            return Result(REPLICATE, [Want(m, REPLICATE) for m in tensors],
                          conflict=f"{heads} heads not divisible by world size {ctx.world_size}")
        wants.append(Want(n, ctx.placement(n) if alike(n) else target))
    if isinstance(mask, Node):
        mshape = ctx.shape(mask)
        if len(mshape) == 4 and mshape[1] != 1:
            wants.append(Want(mask, target))
        else:
            wants.append(ctx.replicated_want(mask, target))
    return Result(target, wants)
