"""Rules for shape ops: follow the sharded dim through views, transposes, splits and cats."""
from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

import sympy
import torch
from torch.fx import Node

from tpcompile.placement import REPLICATE, Replicate, Shard, moved, piece_shard, segmented, shard, split_dims
from tpcompile.sharding_rules.group_cuts import cuts_local, cuts_reshape, expand_within, inferred, padded_groups, \
    within_size
from tpcompile.sharding_rules.grouped import cut_later, grouped, on_one, regroup
from tpcompile.sharding_rules.padded import padded_reshape, split_cut_segments
from tpcompile.sharding_rules.registry import rule
from tpcompile.sharding_rules.rule_context import (Result, RuleContext, Size, Want, exact_size, norm_dim, period,
                                                    prod, sizes_equal)
from tpcompile.sharding_rules.table import RuleSpec
from tpcompile.sharding_rules.tokens import merged_tokens

ALONG = {"dim_arg": int, "default_dim": int}  # ops acting along one dim: its argument position, default


def _passthrough(node: Node, ctx: RuleContext) -> Optional[Result]:
    """Replicated in, replicated out: the common case for every shape op."""
    x = node.args[0]
    return Result(REPLICATE, [Want(x, REPLICATE)]) if isinstance(ctx.placement(x), Replicate) else None


def _fail(node: Node, why: str) -> Result:
    return Result(REPLICATE, [Want(node.args[0], REPLICATE)], conflict=why)


def _groups(ins: Sequence[Size], outs: Sequence[Size]) -> Optional[list[tuple[list[int], list[int]]]]:
    """Pair runs of input dims with runs of output dims of equal element count.

    Where dynamic sizes defeat it (a padded length cut into chunks of size `T // (T // 64)`), the dims equal at
    both ends pair one to one (a reshape is the identity on them) and the dims between them are one run."""
    return _runs(ins, outs) or _ends(ins, outs)


def _ends(ins: Sequence[Size], outs: Sequence[Size]) -> Optional[list[tuple[list[int], list[int]]]]:
    front, back, n = 0, 0, min(len(ins), len(outs))
    while front < n and sizes_equal(ins[front], outs[front]):
        front += 1
    while back < n - front and sizes_equal(ins[-1 - back], outs[-1 - back]):
        back += 1
    middle = (list(range(front, len(ins) - back)), list(range(front, len(outs) - back)))
    return None if not middle[0] or not middle[1] else (  # (only size-1 dims differ: the pairing handles those)
        [([d], [d]) for d in range(front)] + [middle]
        + [([len(ins) - 1 - b], [len(outs) - 1 - b]) for b in reversed(range(back))])


def _runs(ins: Sequence[Size], outs: Sequence[Size]) -> Optional[list[tuple[list[int], list[int]]]]:
    groups, i, j = [], 0, 0
    while i < len(ins) or j < len(outs):
        gi, gj = [], []
        pi, pj = 1, 1
        if i < len(ins):
            gi.append(i); pi = ins[i]; i += 1
        if j < len(outs):
            gj.append(j); pj = outs[j]; j += 1
        while not sizes_equal(pi, pj):
            if (j >= len(outs) or _smaller(pi, pj)) and i < len(ins):
                gi.append(i); pi = pi * ins[i]; i += 1
            elif j < len(outs):
                gj.append(j); pj = pj * outs[j]; j += 1
            else:
                return None
        groups.append((gi, gj))
    return groups


def _smaller(a: Size, b: Size) -> bool:
    """True when a divides b and is smaller (ints or sympy products of dynamic dims)."""
    if isinstance(a, int) and isinstance(b, int):
        return a < b
    _, den = sympy.fraction(sympy.simplify(sympy.sympify(b) / sympy.sympify(a)))
    return den == 1


def reshape_placement(p: Shard, ins: Sequence[Size], outs: Sequence[Size], ws: int) -> tuple[Optional[Shard], str]:
    """Where a sharded dim lands after a reshape, tracked as repeated runs of per-rank blocks.

    Along the reshaped dims the elements form `count` repetitions of the blocks `segs * inner`
    (count may be a dynamic size, e.g. the batch folded into heads); each block is split evenly
    over the ranks. The output dim that holds whole blocks, evenly divisible, is the new shard.
    """
    if p.split_next is not None:  # (piece, part of the next dim) is one contiguous 1/ws block
        if p.dim + 1 >= len(ins):
            return None, "grouped split reaches past the last dim"
        merged = list(ins[:p.dim]) + [ins[p.dim] * ins[p.dim + 1]] + list(ins[p.dim + 2:])
        return reshape_placement(padded_groups(p, ins, ws) or Shard(p.dim), merged, outs, ws)
    groups = _groups(ins, outs)
    if groups is None:
        return None, "cannot match the input and output dims"
    for gi, gj in groups:
        if p.dim not in gi:
            continue
        if len(gi) == 1 and len(gj) == 1:
            return moved(p, gj[0]), ""
        if p.rank_cuts:  # a group's query heads split among the ranks sharing its kv head
            return cuts_reshape(p, gi, gj, ins, outs)
        if p.padding is not None:
            return padded_reshape(p, gi, gj, ins, outs, ws)
        t = gi.index(p.dim)
        count = (p.outer or 1) * prod([ins[d] for d in gi[:t]])
        inner = prod([ins[d] for d in gi[t + 1:]])
        if not isinstance(inner, int):
            return None, "the sharded dim is merged with a dynamic dim after it"
        segs = list(p.segments or (exact_size(ins[p.dim] / (p.outer or 1)),))
        blocks = [s * inner for s in segs]  # one repetition, in element order
        outs_g = [outs[d] for d in gj]
        why = f"reshape to {tuple(outs)} cuts through the per-rank blocks of dim {p.dim}"
        for u, size in enumerate(outs_g):
            q, pre = prod(outs_g[u + 1:]), prod(outs_g[:u])
            if size == 1 or not isinstance(q, int) or any(f % q for f in blocks):
                continue
            if p.cuts is not None and p.pieces is None:  # segments in fewer pieces than ranks: one run of them
                one, counts = [f // q for f in blocks], p.counts(ws)
                if sizes_equal(pre, count) and size == sum(one) and not any(s % g for s, g in zip(one, counts)):
                    return segmented(gj[u], one, ws, counts=counts), ""
                continue
            one = period([f // q for f in blocks])
            k = len(blocks) // len(one)  # repetitions inside one run of blocks
            m = exact_size(sympy.sympify(size) / sum(one))  # runs folded into this dim
            if m is None or not sizes_equal(pre * m, count * k):
                continue
            if p.seq and inner // q > 1 and all(sympy.sympify(s).is_number for s in segs):
                why = (f"reshape of {tuple(ins)} to {tuple(outs)} flattens {inner // q} entries of each of {segs[0]} "
                       f"tokens, a count fixed by the model, into dim {gj[u]}; its size does not tell them apart")
                continue  # (a length the model leaves dynamic, k * T, does: layouts/token_shares.tokens_of)
            merged = merged_tokens(blocks, inner, q, ws) if p.seq else 1
            if merged > 1:  # the tokens are gathered first (passes/op_result.py, gathering_seq)
                why = (f"reshape of {tuple(ins)} to {tuple(outs)} puts {merged} neighbouring tokens in one entry "
                       f"of dim {gj[u]}; a rank's share of the tokens need not be a multiple of {merged}")
                continue
            held = grouped(p, one, m, pre, count, outs_g, u, ws)
            if held:  # fewer groups than ranks, each split along the next dim: (kv heads, group, head_dim)
                return replace(held, dim=gj[u]), ""
            if not p.seq and any(s % (p.pieces or ws) for s in one):  # a finer dim may still hold whole blocks
                why = (f"reshape splits a sharded dim of size {ins[p.dim]} into ({'x'.join(map(str, outs_g))}); "
                       f"{size} is not divisible by world size {ws}")
                continue
            # tokens (seq) are split at run time, in shares of any count (layouts/token_shares.py)
            if isinstance(m, int) and m > 1 and p.pieces is None and not p.seq:  # m known repetitions: segments
                return shard(gj[u], list(one) * m), ""
            if p.pieces:  # one segment in pieces, as it was
                return piece_shard(gj[u], one[0], p.pieces, outer=None if m == 1 else m, seq=p.seq), ""
            return replace(shard(gj[u], one), outer=None if m == 1 else m, seq=p.seq), ""
        return None, why
    return None, "sharded dim not found"


@rule("reshape", args={"shape_arg": int, "sizes_arg": int, "dim_arg": int})
def reshape(node: Node, spec: RuleSpec, ctx: RuleContext) -> Result:
    """view / reshape / flatten / (un)squeeze."""
    done = _passthrough(node, ctx)
    if done:
        return done
    x = node.args[0]
    p = ctx.placement(x)
    if p.pieces == 1 and p.split_next is None:  # whole on every rank (one kv head for all): global shape
        groups = _groups(ctx.shape(x), ctx.shape(node)) or []
        dims = next((gj for gi, gj in groups if p.dim in gi), [])
        ones = [j for j in dims if ctx.shape(node)[j] == 1] or dims[:1]
        if ones:
            return Result(piece_shard(ones[0], ctx.shape(node)[ones[0]], 1), [Want(x, p)])
    out, why = reshape_placement(p, ctx.shape(x), ctx.shape(node), ctx.world_size)
    if out is not None and out.split_next and p.split_next is None and cut_later(node, out.dim + 1):
        out, why = None, f"reshape splits dim {out.dim + 1} within pieces, and a later op cuts along it"
    if out is None:
        res = _fail(node, why)
        res.regroup = regroup(p, ctx.shape(x), ctx.shape(node), ctx.world_size, reshape_placement)
        return res
    outs = ctx.shape(node)
    if spec.get("shape_arg") is not None and out.dim > 0 and outs[out.dim - 1] == 1 and p.dim < len(ctx.shape(x)) \
            and sizes_equal(ctx.shape(x)[p.dim], outs[out.dim]) and len(outs) > len(ctx.shape(x)) \
            and not all(getattr(u.meta.get("tp_rule"), "rule", None) in ("pointwise", "reduce") for u in node.users):
        # (.., N) viewed as (.., 1, N): one head of N, which whole heads cannot split (one group for a norm can)
        return _fail(node, f"reshape makes 1 head of {outs[out.dim]}; one head cannot be split "
                           f"across {ctx.world_size} ranks")
    cut = cuts_local(out, ctx.world_size) if out.rank_cuts else None  # a cut dim's size on every rank
    if out.rank_cuts and cut is None:
        return _fail(node, f"reshape gives the ranks different sizes of the explicitly cut dim {out.dim}")
    res = Result(out, [Want(x, p)])
    if out.rank_cuts and out.outer is not None and spec.get("shape_arg") is not None:  # heads folded into rows:
        if not inferred(node.args[spec.get("shape_arg")], out.dim):  # their count only as -1
            return _fail(node, f"reshape folds the explicitly cut dim into dim {out.dim} of a size given as a number")
    elif spec.get("shape_arg") is not None and (out.shared(ctx.world_size) and not out.pieces or out.rank_cuts):
        local = sum(out.seg_local(ctx.world_size)) if cut is None else cut
        res.localize = [("shape_set", spec.get("shape_arg"), (out.dim, local), None)]
    elif spec.get("shape_arg") is not None:
        res.localize = [("shape", spec.get("shape_arg"), out.dim, out.pieces)]
    elif spec.get("sizes_arg") is not None:  # unflatten: sizes of the dims that replace `dim`
        first = norm_dim(node.args[spec.get("dim_arg")], len(ctx.shape(x)))
        if 0 <= out.dim - first < len(node.args[spec.get("sizes_arg")]):
            res.localize = [("shape", spec.get("sizes_arg"), out.dim - first, out.pieces)] if not out.rank_cuts else \
                [("shape_set", spec.get("sizes_arg"), (out.dim - first, cut), None)]
    if res.localize and out.within is not None and res.localize[0][0] == "shape":  # the next dim, cut in a piece
        res.localize.append(within_size(out, res.localize[0][1], res.localize[0][2] + 1))
    return res


@rule("expand", args={"shape_arg": int})
def expand(node: Node, spec: RuleSpec, ctx: RuleContext) -> Result:
    """expand: new leading dims shift the sharded dim; its size literal becomes per-rank."""
    done = _passthrough(node, ctx)
    if done:
        return done
    x = node.args[0]
    p = ctx.placement(x)
    out = moved(p, p.dim + len(ctx.shape(node)) - len(ctx.shape(x)))
    out, loc = expand_within(p, out, ctx.shape(x), ctx.shape(node), bool(spec.get("pad_within")), ctx.world_size)
    return Result(out, [Want(x, p)], localize=loc)


@rule("transpose")
def transpose(node: Node, spec: RuleSpec, ctx: RuleContext) -> Result:
    """transpose / t: the sharded dim moves with the swap."""
    done = _passthrough(node, ctx)
    if done:
        return done
    x = node.args[0]
    p, nd = ctx.placement(x), len(ctx.shape(x))
    d0, d1 = (norm_dim(node.args[1], nd), norm_dim(node.args[2], nd)) if len(node.args) > 2 else (0, 1)
    d = d1 if p.dim == d0 else d0 if p.dim == d1 else p.dim
    return Result(moved(p, d), [Want(x, p)])


@rule("reverse")
def reverse(node: Node, spec: RuleSpec, ctx: RuleContext) -> Result:
    """numpy_T (`W.T`): every dim reversed, so the sharded dim d lands at ndim - 1 - d."""
    done = _passthrough(node, ctx)
    if done:
        return done
    x = node.args[0]
    p = ctx.placement(x)
    return Result(moved(p, len(ctx.shape(x)) - 1 - p.dim), [Want(x, p)])


@rule("permute")
def permute(node: Node, spec: RuleSpec, ctx: RuleContext) -> Result:
    """permute: the sharded dim goes where the permutation puts it."""
    done = _passthrough(node, ctx)
    if done:
        return done
    x = node.args[0]
    p, nd = ctx.placement(x), len(ctx.shape(x))
    dims = [norm_dim(d, nd) for d in node.args[1]]
    return Result(moved(p, dims.index(p.dim)), [Want(x, p)])


def along(node: Node, spec: RuleSpec, ndim: int) -> int:
    """The dim an op acting along one dim names (its argument, or its default), normalised."""
    i = spec.get("dim_arg")
    dim = node.args[i] if i < len(node.args) else node.kwargs.get("dim", spec.get("default_dim", 0))
    return norm_dim(dim, ndim)


@rule("split", args=ALONG)
def split(node: Node, spec: RuleSpec, ctx: RuleContext) -> Result:
    """split / split_with_sizes / chunk: pieces along the sharded dim must be whole segments."""
    x = node.args[0]
    p = ctx.placement(x)
    pieces = [v.shape for v in node.meta["val"]]
    if isinstance(p, Replicate):
        return Result(tuple(REPLICATE for _ in pieces), [Want(x, REPLICATE)])
    dim = along(node, spec, len(ctx.shape(x)))
    if p.split_next and dim == p.dim + 1:
        return _fail(node, f"split along dim {dim}, which is split within pieces")
    if p.dim != dim:
        return Result(tuple(p for _ in pieces), [Want(x, p)])
    if p.seq:  # pieces of the tokens are not pieces of each rank's share (the tokens are gathered first)
        return _fail(node, f"split along dim {dim}, whose tokens the ranks hold in shares")
    if p.seg_padded or p.rank_cuts:  # segments each padded, or one piece a rank: pieces of whole cut segments
        return split_cut_segments(node, p, [int(s[dim]) for s in pieces], ctx.world_size)
    segs, ws = list(p.segments or (ctx.shape(x)[dim],)), ctx.world_size
    if p.padded is not None:  # one segment zero-padded: its pieces are not the ranks' blocks
        return _fail(node, f"split into {[int(s[dim]) for s in pieces]} cuts through the per-rank blocks {segs} of "
                           f"dim {dim}")
    counts = p.counts(ws)
    outs, local, k = [], [], 0
    for shape in pieces:
        want, got, gs = int(shape[dim]), [], []
        while k < len(segs) and sum(got) < want:
            got.append(segs[k]); gs.append(counts[k]); k += 1
        if sum(got) != want:
            return _fail(node, f"split into {[int(s[dim]) for s in pieces]} cuts through the per-rank "
                               f"blocks {segs} of dim {dim}")
        outs.append(on_one(segmented(dim, got, ws, counts=gs), shape))
        local.append(sum(s // g for s, g in zip(got, gs)))
    if any(int(s[dim]) % ws for s, o in zip(pieces, outs) if o.pieces is None and o.cuts is None):
        return _fail(node, "a split piece is not divisible by the world size")
    if not p.shared(ws):
        return Result(tuple(outs), [Want(x, p)], localize=[("split", 1, dim, None)])
    if node.target is torch.ops.aten.chunk.default and len(set(local)) > 1:
        return _fail(node, f"chunk of segments whose parts differ in size on a rank ({local})")
    # segments of fewer pieces than ranks keep more of their size: the local sizes, as they are
    loc = None if node.target is torch.ops.aten.chunk.default else [("set", 1, local, None)]
    return Result(tuple(outs), [Want(x, p)], localize=loc)


@rule("unbind", args=ALONG)
def unbind(node: Node, spec: RuleSpec, ctx: RuleContext) -> Result:
    """unbind: fine along any dim but the sharded one."""
    x = node.args[0]
    p = ctx.placement(x)
    n = len(node.meta["val"])
    if isinstance(p, Replicate):
        return Result(tuple(REPLICATE for _ in range(n)), [Want(x, REPLICATE)])
    dim = along(node, spec, len(ctx.shape(x)))
    if dim in split_dims(p):
        return _fail(node, "unbind along the sharded dim")
    out = moved(p, p.dim - (dim < p.dim))
    return Result(tuple(out for _ in range(n)), [Want(x, p)])
