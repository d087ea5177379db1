"""Attention that reads fewer key/value heads than query heads itself: `scaled_dot_product_attention(...,
enable_gqa=True)`, query head h reading kv head h // (Hq / Hkv), with no repeat of k and v in the graph.

Each rank keeps whole groups: its query heads are those of its kv heads, so its local attention is the same call on
its heads. The query heads are split evenly, or zero-padded by whole groups (head_groups.py pads the query
projection so); the kv heads one block a rank, zero-padded alike, each in a piece of its own held by the ranks
whose query heads read it (2 kv heads at 4 ranks, one query head a rank: ranks 0-1 read kv head 0), or, one kv head
for all (multi-query), whole on every rank. A layout whose blocks are not whole groups is a conflict, as for any
attention input laid out otherwise: query heads padded one a rank over kv heads whole (the kv-head replication
repeat_kv attention gets) would need each rank to read another kv head than the pieces bind to it.
Each kv head may instead be a piece of its own held by the ranks among which its group of query heads is cut
(explicit cuts, passes/head_groups.py: 8 query heads over 2 kv heads at 5 ranks, 2 a rank where whole groups hold
4): every rank's query heads then read its one kv head. Whatever the layouts, `reads_own_kv` checks on each rank's
heads that local query head j reads the kv head the op gives it (local kv head j // (local query / local kv heads)).
"""
from __future__ import annotations

from typing import Any, Optional

from torch.fx import Node

from tpcompile.layouts import binds, dim_layout, holders
from tpcompile.placement import REPLICATE, Shard, pad_cuts, piece_shard
from tpcompile.sharding_rules.rule_context import Result, RuleContext, Want


def gqa_attention(node: Node, ctx: RuleContext, q: Node, k: Node, v: Node, mask: Any) -> Optional[Result]:
    """The sdpa rule's answer for grouped-query attention done by the op itself; None for other attention."""
    if not node.kwargs.get("enable_gqa") or ctx.shape(q)[1] == ctx.shape(k)[1]:
        return None
    tensors = [q, k, v] + ([mask] if isinstance(mask, Node) else [])
    heads, kv, ws = ctx.shape(q)[1], ctx.shape(k)[1], ctx.world_size
    target = _query_split(ctx.placement(q), heads, ws)
    want = None if target is None else kv_split(target, heads, kv, ws)
    if want is not None and not reads_own_kv(target, want, heads, kv, ws):
        want = None
    if want is None:
        why = (f"{heads} query heads over {kv} kv heads (enable_gqa) laid out as {ctx.placement(q)} across {ws} ranks: "
               f"a rank's query heads would read kv heads that no split of them gives it")
        pieced = isinstance(ctx.placement(q), Shard) and ctx.placement(q).pieces  # asks for them one to a rank
        return Result(REPLICATE, [Want(n, REPLICATE) for n in tensors], blame=[q], conflict=why,
                      unpiece=[q] if pieced else None)
    wants = [Want(q, target)]  # (a whole value cut locally to it)
    for n in (k, v):
        p = ctx.placement(n)
        if isinstance(p, Shard) and p != want:
            return Result(REPLICATE, [Want(m, REPLICATE) for m in tensors], blame=[n],
                          conflict=f"attention input sharded as {p}, expected {want}: the kv heads of the query "
                                   f"heads {target} holds")
        wants.append(Want(n, want))
    if isinstance(mask, Node):
        per_head = len(ctx.shape(mask)) == 4 and ctx.shape(mask)[1] != 1
        wants.append(Want(mask, target) if per_head else ctx.replicated_want(mask, target))
    return Result(target, wants)


def _query_split(p: Any, heads: int, ws: int) -> Optional[Shard]:
    """The query heads' split: as they are when split evenly, zero-padded or cut group by group (explicit cuts) on
    the heads dim; whole queries cut evenly when the ranks divide their heads; else None."""
    if isinstance(p, Shard):
        cut = p.rank_cuts and p.outer is None and p.split_next is None  # each group cut among its kv head's ranks
        return p if p.dim == 1 and (p.plain or p.plain_padded or cut) and not p.seq else None
    return Shard(1) if heads % ws == 0 else None


def kv_split(target: Shard, heads: int, kv: int, ws: int) -> Optional[Shard]:
    """The kv heads' split that gives every rank the kv heads of its query heads, or None."""
    rep = heads // kv
    if heads % kv:
        return None
    if target.rank_cuts:  # each group's query heads cut among the ranks holding its kv head, a piece of its own
        return piece_shard(1, kv, kv) if kv > 1 and binds(ws, kv) else None
    local = (heads if target.padded is None else target.padded) // ws  # query heads a rank, padding included
    if kv == 1:  # multi-query: the one kv head whole on every rank
        return piece_shard(1, 1, 1)
    if local % rep == 0:  # whole groups a rank: its kv heads one block, zero-padded past the last
        per = local // rep
        return Shard(1) if per * ws == kv else Shard(1, cuts=pad_cuts(per * ws, ws)) if per * ws > kv else None
    if target.padded is None and rep % local == 0 and ws % kv == 0 and holders(ws, kv) == rep // local:
        return piece_shard(1, kv, kv)  # a group's query heads spread over the ranks sharing its kv head
    return None


def reads_own_kv(q: Shard, kv_p: Shard, heads: int, kv: int, ws: int) -> bool:
    """True when on every rank each real query head that the split `q` gives it reads, in the op's local grouping
    (local query head j reads local kv head j // (local query heads / local kv heads)), the kv head of its group
    (query head h reads kv head h // (heads / kv)) that the split `kv_p` gives it."""
    rep = heads // kv
    for rank in range(ws):
        q_heads, kv_heads = _local_heads(q, heads, rank, ws), _local_heads(kv_p, kv, rank, ws)
        if not kv_heads or len(q_heads) % len(kv_heads):
            return False
        per = len(q_heads) // len(kv_heads)
        if any(h is not None and kv_heads[j // per] != h // rep for j, h in enumerate(q_heads)):
            return False
    return True


def _local_heads(p: Shard, heads: int, rank: int, ws: int) -> list:
    """The global head at each local position of the heads dim on `rank` (None: zero padding)."""
    layout = dim_layout(p, heads, ws)
    out: list = [None] * layout.local_size(rank)
    for start, loc, n, _ in layout.runs(rank):
        out[loc:loc + n] = range(start, start + n)
    return out
