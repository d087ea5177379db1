"""einsum of activations: the index the split operands are split on carries into the output.

Attention written with einsum keeps whole heads: `bthd,bshd->bhts` on q and k split by heads gives
scores split by heads. Grouped-query attention written over grouped heads views q as
(B, T, kv heads, group, head_dim) and k as (B, S, kv heads, head_dim): `btkgd,bskd->bkgts`. When the
world size divides the kv heads both are split on the kv-head index k and the group index g stays
whole. With fewer kv heads than ranks, k and v are in pieces (`piece_shard`, n pieces: each kv head held by
the ranks that share it) and q is split along k in the same pieces and along g within each piece
(`Shard.within`), so every rank keeps its own query heads; the output carries both. One kv head for all
(multi-query, one piece) is whole on every rank, and the split is q's (its group index).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from torch.fx import Node

from tpcompile.layouts import Segment
from tpcompile.placement import REPLICATE, Shard, moved
from tpcompile.sharding_rules.registry import rule
from tpcompile.sharding_rules.rule_context import Result, RuleContext, Want
from tpcompile.sharding_rules.table import RuleSpec


def parse(equation: str) -> Optional[tuple[list[str], str]]:
    """(operand terms, output term) of an explicit einsum equation without ellipsis, else None."""
    lhs, arrow, out = equation.replace(" ", "").partition("->")
    if "." in equation or not arrow or not out:
        return None
    return lhs.split(","), out


@rule("einsum")
def einsum(node: Node, spec: RuleSpec, ctx: RuleContext) -> Result:
    """einsum: a sharded index that survives into the output stays sharded there (with the index split after
    it within each piece, for grouped heads)."""
    equation, operands = node.args[0], list(node.args[1])
    whole = [Want(n, REPLICATE) for n in operands]
    if ctx.all_replicated(operands):
        return Result(REPLICATE, whole)
    parsed = parse(equation)
    if parsed is None or len(parsed[0]) != len(operands):
        return Result(REPLICATE, whole, conflict="einsum with ellipsis or implicit output")
    terms, out = parsed
    split = [(t, ctx.placement(n)) for n, t in zip(operands, terms) if isinstance(ctx.placement(n), Shard)]
    # a value whole on every rank (one kv head for all, one piece) is read as it is, on whatever index
    split = [(t, p) for t, p in split if p.pieces != 1] or split
    letters = {t[p.dim] for t, p in split}
    if len(letters) != 1 or len({(p.segments, p.padding, p.pieces, p.outer) for _, p in split}) != 1:
        return Result(REPLICATE, whole, conflict="einsum operands sharded on different indices")
    letter, like = letters.pop(), replace(split[0][1], within=None)
    if letter not in out:
        return Result(REPLICATE, whole, conflict=f"einsum sums over the sharded index {letter!r}")
    nxt, why = _split_next(split, terms, operands, out, letter, ctx)
    if why:
        return Result(REPLICATE, whole, conflict=why)
    target = replace(moved(like, out.index(letter)), within=nxt[1] if nxt else None)
    wants = []
    for n, term in zip(operands, terms):
        p = ctx.placement(n)
        if letter not in term:
            wants.append(Want(n, p) if isinstance(p, Shard) and p.pieces == 1 else ctx.replicated_want(n, target))
        elif isinstance(p, Shard) or ctx.shape(n)[term.index(letter)] != 1:
            grouped = nxt is not None and nxt[0] in term
            wants.append(Want(n, replace(moved(like, term.index(letter)), within=nxt[1] if grouped else None)))
        else:
            wants.append(ctx.replicated_want(n, target))
    return Result(target, wants)


def _split_next(split: list, terms: list[str], operands: list[Node], out: str, letter: str,
                ctx: RuleContext) -> tuple[Optional[tuple[str, Segment]], Optional[str]]:
    """(the index cut within each piece, its cut: `Shard.within`) when an operand has one (grouped heads at more
    ranks than kv heads), and why the op cannot keep it, if it cannot."""
    found = {(t[p.dim + 1] if p.dim + 1 < len(t) else "", p.within) for t, p in split if p.within is not None}
    if not found:
        return None, None
    if len(found) > 1 or "" in {g for g, _ in found}:
        return None, "einsum operands split within their pieces along different indices"
    g, f = found.pop()
    for n, term in zip(operands, terms):
        p = ctx.placement(n)
        if g in term and (letter not in term or term.index(g) != term.index(letter) + 1
                          or not isinstance(p, Shard) or p.within != f):
            return None, f"einsum operand {n.name} holds the index {g!r} whole, which another splits {f.pieces} ways"
    if g not in out or out.index(g) != out.index(letter) + 1:
        return None, f"einsum sums over or moves the index {g!r} that is split within each piece"
    return (g, f), None
