"""Attention that reads fewer key/value heads than query heads itself: `scaled_dot_product_attention(...,
enable_gqa=True)`, query head h reading kv head h // (Hq / Hkv), with no repeat of k and v in the graph.

Each rank keeps whole groups: its query heads are those of its kv heads, so its local attention is the same call on
its heads. The query heads are split evenly, or zero-padded by whole groups (head_groups.py pads the query
projection so); the kv heads one block a rank, zero-padded alike, each in a piece of its own held by the ranks
whose query heads read it (2 kv heads at 4 ranks, one query head a rank: ranks 0-1 read kv head 0), or, one kv head
for all (multi-query), whole on every rank. A layout whose blocks are not whole groups is a conflict, as for any
attention input laid out otherwise: query heads padded one a rank over kv heads whole (the kv-head replication
repeat_kv attention gets) would need each rank to read another kv head than the pieces bind to it.
"""
from __future__ import annotations

from typing import Any, Optional

from torch.fx import Node

from tpcompile.layouts import holders
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
    if want is None:
        why = (f"{heads} query heads over {kv} kv heads (enable_gqa) laid out as {ctx.placement(q)} across {ws} ranks: "
               f"a rank's query heads are not whole groups of its kv heads")
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
    """The query heads' split: as they are when split evenly or zero-padded on the heads dim; whole queries cut
    evenly when the ranks divide their heads; else None."""
    if isinstance(p, Shard):
        return p if p.dim == 1 and (p.plain or p.plain_padded) and not p.seq else None
    return Shard(1) if heads % ws == 0 else None


def kv_split(target: Shard, heads: int, kv: int, ws: int) -> Optional[Shard]:
    """The kv heads' split that gives every rank the kv heads of its query heads, or None."""
    rep = heads // kv
    local = (heads if target.padded is None else target.padded) // ws  # query heads a rank, padding included
    if heads % kv:
        return None
    if kv == 1:  # multi-query: the one kv head whole on every rank
        return piece_shard(1, 1, 1)
    if local % rep == 0:  # whole groups a rank: its kv heads one block, zero-padded past the last
        per = local // rep
        return Shard(1) if per * ws == kv else Shard(1, cuts=pad_cuts(per * ws, ws)) if per * ws > kv else None
    if target.padded is None and rep % local == 0 and ws % kv == 0 and holders(ws, kv) == rep // local:
        return piece_shard(1, kv, kv)  # a group's query heads spread over the ranks sharing its kv head
    return None

