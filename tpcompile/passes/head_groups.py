"""Grouped-query attention whose kv heads the world size does not divide: pad the query heads by whole groups.

With Hq query heads sharing kv heads in groups of n_rep (Hq = kv x n_rep), a split by heads keeps each
rank's query heads with the kv heads they read only if a rank holds whole groups. When the world size
does not divide the kv heads, nor is a multiple of them that divides the query heads (4 kv heads for 12
query heads at 3, 6 or 8 ranks), there are two exact ways to split the attention:

- kv-head replication: query heads split ceil(Hq / ws) a rank, the kv projections whole on every rank
  (sharding_rules/matmul.py `sdpa` makes that choice when the layouts do not line up);
- whole groups: kv heads zero-padded to ceil(kv / ws) a rank, the query heads padded to n_rep times that,
  so that rank r's query heads are exactly those of its kv heads.

When the world size is a multiple of the kv heads (4 kv heads at 8 ranks, each shared by 2 ranks) there is a
third way, which holds the least: each kv head in a piece of its own, and its group of query heads split among
the ranks sharing it, zero-padded to a multiple of them (3 heads at 2 ranks: 2 | 1 and a zero head; explicit
cuts, sharding_rules/group_cuts.py). Where the ranks do not divide the kv heads this third way still applies when
it holds less than the other two (2 kv heads of 4 query heads at 5 ranks: kv head 0 held by ranks 0-2, kv head 1
by ranks 3-4, `layouts.holders`; every rank one query head, rank 2's a zero head). Separate query, key and value
projections are split so whenever it applies (the query projection's `kv_groups`, the key and value projections'
pieces, the kv repeats' `pad_within`), and a fused q|k|v projection with more than one kv head too (its
`kv_groups`: one cut of its q, k and v segments).

This pass finds each attention (`scaled_dot_product_attention`, or written out: q @ k^T, a softmax, @ v),
its query, key and value projections (through the views, transposes, rotary
embedding and kv repeats between them; one fused q|k|v projection's three segments too) and, where whole
groups hold no more parameter bytes on the largest rank (query and output projections against key and
value projections, one head each; a tie goes to the groups, as the kv heads, and a KV cache of them, are
then split), marks the query projection's `unit` as a group of heads (n_rep x head_dim) and the key and
value projections' as one head; the matmul rule then pads the query heads to whole groups and the kv heads to a
multiple of the ranks.

Attention that reads the kv heads itself (`scaled_dot_product_attention(..., enable_gqa=True)`) has no repeat to
cut and no kv-head replication (each rank would read kv heads the pieces do not bind to it): where the ranks do not
split it evenly or in pieces, its groups are cut among the ranks of their kv heads where that holds less (8 query
heads on 2 kv heads at 5 ranks: 2 a rank), else padded by whole groups whatever the bytes (sharding_rules/gqa.py).

Fewer heads than ranks, as many kv heads as query heads (4 heads at 8 ranks): every projection's unit is one
head, so the heads are zero-padded to one a rank rather than cut into pieces shared by ranks (which would
compute each query head on several ranks and count it that many times in the output projection's sum).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx import GraphModule, Node

from tpcompile.layouts import binds, holders
from tpcompile.passes.head_projections import (MATMUL, SCORES, SDPA, WALK, biases, gates, head_size,
                                               kv_companions, projection, transposed)
from tpcompile.passes.pass_context import PassContext
from tpcompile.sharding_rules import RuleSpec
from tpcompile.sharding_rules.group_cuts import per_rank


def attentions(gm: GraphModule) -> list[tuple[Node, Node, Node, Node]]:
    """(output, q, k, v) of each attention: scaled_dot_product_attention, or one written out: q @ k^T (k transposed
    in its last two dims), the scores through a softmax, a mask, a scale or a cast, @ v."""
    out = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in SDPA and len(node.args) >= 3:
            out.append((node, *node.args[:3]))
        elif node.op == "call_function" and node.target in MATMUL and transposed(node.args[1]):
            product = _values(node)
            if product is not None:
                out.append((product, node.args[0], node.args[1].args[0], product.args[1]))
    return [t for t in out if all(isinstance(a, Node) for a in t)]


def _values(scores: Node) -> Optional[Node]:
    """The product of the scores, softmaxed, with v: the one matmul they reach as its first operand past a softmax
    (the users followed that hold tensors: checks of the metadata and sizes read aside; branches too, as a
    logsumexp of the scores for attention sinks, GraniteMoe's), within SCORES ops of them."""
    found, todo, seen = set(), [(scores, False, 0)], set()
    while todo:
        n, softmaxed, depth = todo.pop()
        for u in n.users:
            if not isinstance(u.meta.get("val"), torch.Tensor) or (u, softmaxed) in seen or depth >= SCORES:
                continue
            seen.add((u, softmaxed))
            if u.target in MATMUL:
                if softmaxed and u.args[0] is n:
                    found.add(u)
                continue
            todo.append((u, softmaxed or "softmax" in str(u.target), depth + 1))
    return found.pop() if len(found) == 1 else None


def mark_head_groups(gm: GraphModule, ctx: PassContext) -> None:
    """Set `unit` on the query projection of each grouped-query attention best split by whole groups."""
    ws = ctx.world_size
    for out, q_arg, k_arg, v_arg in attentions(gm):
        found = [projection(a, ctx, head_size(a)) for a in (q_arg, k_arg, v_arg)]
        q_val = q_arg.meta.get("val")
        if any(f is None for f in found) or q_val is None:
            continue
        fused = len({id(f) for f in found}) == 1  # one q|k|v projection (Phi-3): its three segments
        if not fused and any(f.meta["tp_rule"].get("segments") for f in found):
            continue  # runs of heads, each padded by whole heads (passes/head_runs.py)
        segments = found[0].meta["tp_rule"].get("segments") if fused else None
        if fused and (segments is None or len(segments) != 3) or not fused and len({id(f) for f in found}) < 3:
            continue
        hd = int(q_val.shape[-1])
        q, k, v = segments or (int(f.meta["val"].shape[-1]) for f in found)
        if k != v or q % hd or k % hd:
            continue
        heads, kv = q // hd, k // hd
        if heads == kv and 0 < heads < ws and ws % heads == 0:  # fewer heads than ranks: padded, one a rank
            _set_units(found, fused, (hd, hd, hd))  # (in pieces shared by ranks, query heads are computed twice)
            continue
        if kv == 0 or heads % kv or heads == kv or kv % ws == 0 or ws % kv == 0 and heads % ws == 0:
            continue  # kv heads split evenly, or in pieces shared by the ranks of whole query heads
        rep = heads // kv
        groups = 2 * -(-kv // ws) * rep + 2 * -(-kv // ws)  # q and o heads, k and v heads: padded groups
        replicated = 2 * -(-heads // ws) + 2 * kv  # q and o split by heads, k and v whole
        # the op reading the kv heads itself (enable_gqa, no repeat to cut): whole groups or groups cut within the
        # kv pieces, the ways it splits (one kv head for all: whole on every rank, the query heads split as they are)
        by_op = out.target in SDPA and bool(out.kwargs.get("enable_gqa")) and kv > 1
        units = (rep * hd, hd, hd) if groups <= replicated or by_op else None  # q by whole groups; k, v by heads
        # a gate of the merged heads, a bias of the scores: (projection, head size), cut as the query heads are
        beside = [(g, hd) for g in gates(out, q, found, ctx)] + biases(out, heads, found, ctx) if units else []
        # kv heads in pieces, each group's query heads cut among the ranks holding its kv head
        if _within(heads, kv, ws, groups if by_op else min(groups, replicated)) and (not fused or kv > 1):
            _split_groups(found, (k_arg, v_arg), kv, holders(ws, kv), hd, ctx, units, fused, beside)
        elif units:
            _set_units(found, fused, units, beside)


def _within(heads: int, kv: int, ws: int, other: int) -> bool:
    """True when kv heads in pieces, each group's query heads cut among the ranks holding its kv head, is the split:
    the ranks divide the kv heads, or else (2 kv heads at 5 ranks: held by ranks 0-2 and 3-4, `layouts.holders`)
    every piece has ranks and a rank holds fewer heads so (q and o, as many as the last piece's fewer ranks need,
    `group_cuts.per_rank`; k and v) than `other`, the heads a rank holds padded by whole groups or with the kv
    heads whole."""
    if ws % kv == 0:
        return True
    return binds(ws, kv) and 2 * per_rank(heads // kv, kv, ws) + 2 < other


def _split_groups(found: list, kv_args: tuple, kv: int, share: int, hd: int, ctx: PassContext,
                  units: Optional[tuple], fused: bool, gates: list) -> None:
    """Each kv head in a piece of its own (held by `share` ranks), its group of query heads split among those ranks
    and zero-padded to a multiple of them (sharding_rules/group_cuts.py), and a gate of the merged heads with them;
    the kv repeats between the key and value projections and the attention padded alike (`pad_within`). A fused
    q|k|v projection gets it all in one cut: its q segment by groups, its k and v segments in kv pieces
    (sharding_rules/matmul.py `_group_cut`).
    `units`: the whole groups to fall back on (None: kv-head replication), should propagation blame one of the
    three projections (give_up_group_cuts)."""
    q, k, v = found
    for proj, head in ((q, hd), *gates):  # a gate of the merged heads, a bias of the scores: as the query heads
        add_args(proj, kv_groups=(kv, share, head))
    companions = [] if fused else kv_companions(kv_args, (k, v), kv, ctx)
    for proj in () if fused else (k, v, *companions):
        ctx.pieces[proj] = kv
    repeats = [n for arg, proj in zip(kv_args, (k, v)) for n in _between(arg, proj)
               if getattr(n.meta.get("tp_rule"), "rule", None) == "expand"]
    for n in repeats:
        add_args(n, pad_within=True)
    for proj in (*found, *(g for g, _ in gates), *companions):
        ctx.group_cuts[proj] = (tuple(found), tuple(repeats), units, fused, tuple(gates), tuple(companions))


def give_up_group_cuts(blamed: set, ctx: PassContext) -> set:
    """The projections of every attention whose group cut a blamed op belongs to, set back to the whole groups or
    the kv-head replication head_groups would have chosen without it (a reduction over a whole projection's
    features, OLMoE's q and k norms, cannot read kv heads in pieces); the next round places them so."""
    undone: set = set()
    for o in blamed & set(ctx.group_cuts):
        if o not in ctx.group_cuts:  # given up with another projection of its attention
            continue
        found, repeats, units, fused, gates, companions = ctx.group_cuts[o]
        for n in (*found, *repeats, *(g for g, _ in gates), *companions):
            spec = n.meta["tp_rule"]
            n.meta["tp_rule"] = RuleSpec(spec.rule, {a: b for a, b in spec.args.items()
                                                     if a not in ("kv_groups", "pad_within", "grouped")})
            ctx.pieces.pop(n, None)
            ctx.group_cuts.pop(n, None)
        if units:
            _set_units(list(found), fused, units, gates)
        undone |= set(found)
    return undone


def add_args(node: Node, **args: object) -> None:
    spec = node.meta["tp_rule"]
    node.meta["tp_rule"] = RuleSpec(spec.rule, {**spec.args, **args})


def _between(arg: Node, proj: Node) -> list[Node]:
    """The nodes on the way from a projection to an attention input (walked back from the input)."""
    todo, seen = [arg], set()
    while todo and len(seen) < WALK:
        n = todo.pop()
        if n in seen or n is proj or not isinstance(n, Node):
            continue
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return list(seen)


def _set_units(found: list, fused: bool, units: tuple, gates: tuple = ()) -> None:
    """The query, key and value projections' units (of the fused projection, one per segment); a gate of the
    merged heads, or a bias of the scores, (projection, head size), the query's group of heads of its size."""
    group = units[0] // units[1]  # (query heads of a group x head size, head size, head size)
    for proj, unit in [*zip(found[:1] if fused else found, (units,) if fused else units),
                       *((g, group * head) for g, head in gates)]:
        spec = proj.meta["tp_rule"]
        proj.meta["tp_rule"] = RuleSpec(spec.rule, {**spec.args, "unit": unit})
