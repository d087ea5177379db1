"""Grouped heads: a split dim viewed as (groups, group size, ..., head_dim) with fewer groups than ranks.

Grouped-query attention written over grouped heads views q, split like any column projection, as
(B, T, kv heads, group, head_dim). With fewer kv heads than ranks no dim of that view holds whole blocks
of the split, but the kv-head dim in `pieces` (each kv head held by world_size / kv heads ranks) with the
group dim split within each piece (`Shard.within`) is exactly each rank's contiguous block, so every rank
keeps its own query heads, and the kv heads line up with k and v held in the same pieces. head_dim, the
last dim, is never the one split within a piece; a view whose group dim a later op cuts (Falcon's
(kv heads, group + 2, head_dim) view of q|k|v, sliced into q, k and v along it) is not grouped this way.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

from torch.fx import Node

from tpcompile.layouts import within_cut
from tpcompile.placement import Shard, moved, piece_shard
from tpcompile.sharding_rules.rule_context import RuleContext, Size, norm_dim, readers, sizes_equal
from tpcompile.sharding_rules.shared_pieces import piece_resized
from tpcompile.sharding_rules.table import lookup


def grouped(p: Shard, one: list, m: Size, pre: Size, count: Size, outs_g: list, u: int, ws: int) -> Optional[Shard]:
    """A plain split of one dim viewed as (a, b, ..., inner) with fewer entries `a` than ranks: `a` pieces, each
    split `ws / a` ways along b (`Shard.within`), so every rank keeps its own contiguous block. Grouped-query
    heads viewed as (kv heads, group, head_dim) at more ranks than kv heads; the last dim (head_dim) is never
    the one split within a piece."""
    size = outs_g[u]
    if p.seq or not p.plain or len(one) != 1 or m != 1 or not sizes_equal(pre, count) or u + 2 >= len(outs_g):
        return None
    nxt = outs_g[u + 1]
    if not isinstance(size, int) or not isinstance(nxt, int) or not 1 < size < ws or ws % size or nxt % (ws // size):
        return None
    return piece_shard(0, size, size, within=within_cut(nxt, ws // size))


def regroup(p: Shard, ins: Sequence[Size], outs: Sequence[Size], ws: int, reshape_placement: Callable) -> Optional[int]:
    """Fewer pieces than ranks that would make this reshape (shape.reshape_placement) work (kv heads fewer than
    ranks)."""
    if not p.plain:
        return None
    size = ins[p.dim]
    for g in range(ws // 2, 1, -1):
        if ws % g or not isinstance(size, int) or size % g:
            continue
        out, _ = reshape_placement(piece_shard(p.dim, size, g, seq=p.seq), ins, outs, ws)
        if out is not None and isinstance(outs[out.dim], int) and outs[out.dim] < ws:
            return g
    return None


_CUTS = {"split": 2, "unbind": 1, "select": 1, "slice": 1}  # rules that cut along a dim: its argument


def cut_later(node: Node, d: int, limit: int = 16) -> bool:
    """True when a reader of `node` (through elementwise ops, transposes and permutes) cuts along dim d: Falcon's
    (kv heads, group + 2, head_dim) view of q|k|v is cut into q, k and v along the group dim."""
    todo, seen = [(node, d)], 0
    while todo and seen < limit:
        n, d = todo.pop()
        for u in readers(n):
            seen += 1
            spec = lookup(u.target) if u.op == "call_function" else None
            rule = spec.rule if spec is not None else None
            if rule in _CUTS:
                i = _CUTS[rule]
                at = u.args[i] if len(u.args) > i else u.kwargs.get("dim", 0)
                if isinstance(at, int) and norm_dim(at, len(RuleContext.shape(n))) == d:
                    return True
                if rule == "slice":  # along another dim (`qkv[:, :, :, :-2]` slices every dim before): the same dims
                    todo.append((u, d))
            elif rule == "index" and len(u.args[1]) > d and u.args[1][d] is not None:
                return True
            elif rule == "pointwise" and len(RuleContext.shape(u) or ()) == len(RuleContext.shape(n)):
                todo.append((u, d))
            elif rule == "transpose" and len(u.args) > 2:
                nd = len(RuleContext.shape(n))
                a, b = norm_dim(u.args[1], nd), norm_dim(u.args[2], nd)
                todo.append((u, b if d == a else a if d == b else d))
            elif rule == "permute":
                todo.append((u, [norm_dim(x, len(u.args[1])) for x in u.args[1]].index(d)))
    return False


def on_one(p: Shard, shape: Sequence) -> Shard:
    """A one-piece split (whole on every rank) moved to the last dim of size 1 before it, where the heads
    of multi-query attention are broadcast from (so that expand splits them among the ranks)."""
    if p.pieces != 1:
        return p
    ones = [d for d in range(p.dim) if isinstance(shape[d], int) and shape[d] == 1]  # not a count of routed tokens
    return piece_resized(moved(p, ones[-1]), 1) if ones else p
