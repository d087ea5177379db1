"""Splits laid out in segments, pieces or repeated blocks: this rank's part of a whole value, and the
collectives of tokens flattened with the batch.

A plain split of a whole value is `tpcompile.scatter` (no communication). For the other layouts
of a split dim (placement.Shard: `segments`, `pieces`, `outer`) the rank's runs are cut with
narrows (and a cat when there are several), after unflattening `outer` repetitions of the
blocks, all without communication. The whole value's gradient is then only this rank's part, so
its source passes `grad_all_reduce` first (identity forward, all-reduce backward), keeping the
invariant that a whole value carries a whole gradient.

A token split (sequence parallelism) is cut by `rewrite_tokens.scatter_tokens` instead.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch.fx import Node

from tpcompile.layouts import dim_layout
from tpcompile.placement import Shard
from tpcompile.sharding_rules.padded import zero_padded
from tpcompile.sharding_rules.rule_context import to_size

aten = torch.ops.aten
tp = torch.ops.tpcompile


def local_slice(em: Any, src: Node, node: Node, p: Shard, sync: bool = True, piece: Optional[Shard] = None) -> Node:
    """Rank em.rank's part, split as `p`, of the whole value `src` (the rank graph's value of `node`), or, with
    `piece` (the value in fewer pieces than ranks), of the rank's piece `src`.

    sync=False for a value held in shared pieces whose gradient is summed over the ranks where it is made
    (one piece shared by every rank: multi-query's kv heads, `whole_piece`): no grad_all_reduce here."""
    val = node.meta["val"]
    if piece is not None:  # rank r's even block lies in its piece, at its place among the ranks sharing it
        n = int(to_size(val.shape[p.dim])) // em.ws
        return em.call(aten.narrow.default, src, p.dim, em.rank % (em.ws // piece.pieces) * n, n)
    if sync and (val.is_floating_point() or val.is_complex()):
        src = em.call(tp.grad_all_reduce.default, src, em.plan.group)
    layout = dim_layout(p, to_size(val.shape[p.dim]), em.ws)
    dim, x, repeated = p.dim, src, layout.repeat != 1
    if repeated:  # (outer * block, ...) -> (outer, block, ...): the runs repeat in every block
        x = em.call(aten.unflatten.int, x, dim, [-1, int(layout.block)])
        dim += 1
    if p.padded is not None or p.rank_cuts or p.seg_padded:  # this rank's piece of each segment, or its block of
        runs = layout.runs(em.rank)  # the padded dim, its padding zeros (empty past the end)
        x = _blocks(em, x, dim, val.dim() + repeated, [(start, n, block) for start, _, n, block in runs])
    else:
        runs = [em.call(aten.narrow.default, x, dim, a, b - a)  # (in pieces: the one of the ranks sharing it)
                for a, b in layout.blocks(em.rank)]
        x = runs[0] if len(runs) == 1 else em.call(aten.cat.default, runs, dim)
    return em.call(aten.flatten.using_ints, x, dim - 1, dim) if repeated else x


def zero_padding(em: Any, src: Node, x: Node, *, proven: bool = True) -> Node:
    """x, this rank's value of `src` split with zero padding, with whatever its padding holds made zeros (nothing to
    do when the rank's block has none, or, unless `proven=False`, the padding is known to hold zeros:
    padded.zero_padded). A row split's input: the padding meets the padded columns of its weight, whose gradient
    would be the padding's values (sigmoid(0) = 0.5 after a padded MLP width) and train them away from zero. A
    sum over the padded dim (`proven=False`): its gradient at the padding, 1, would train the padded rows of the
    weight that made it away from zero; the zeroed blocks pass none back."""
    runs = padding_runs(em, src)
    if runs is None or proven and zero_padded(src, em.plan.placement, rule=em.plan.rule):
        return x
    return _blocks(em, x, em.plan.placement(src).dim, src.meta["val"].dim(), runs)


def padding_runs(em: Any, src: Node) -> Optional[list[tuple[int, int, int]]]:
    """Per segment, (local start, real length, block) of this rank's value of `src` along its padded dim, when that
    block holds padding; None when it holds none (or `src` is not padded, or padded as `outer` repetitions)."""
    p, val = em.plan.placement(src), src.meta.get("val")
    if not isinstance(p, Shard) or p.padding is None and not p.rank_cuts or p.outer is not None \
            or not isinstance(val, torch.Tensor):
        return None
    runs = [(at, n, block) for _, at, n, block in dim_layout(p, int(to_size(val.shape[p.dim])), em.ws).runs(em.rank)]
    return None if all(n == block for _, n, block in runs) else runs


def _blocks(em: Any, x: Node, dim: int, ndim: int, runs: list[tuple[int, int, int]]) -> Node:
    """Blocks of x along dim joined: per (start, n, block), x's n entries from start, zero-padded to block."""
    tail = [0, 0] * (ndim - 1 - dim)
    parts = []
    for start, n, block in runs:
        if block:  # (an empty piece adds nothing)
            part = em.call(aten.narrow.default, x, dim, start, n)
            parts.append(part if n == block else em.call(aten.constant_pad_nd.default, part, tail + [0, block - n], 0))
    return parts[0] if len(parts) == 1 else em.call(aten.cat.default, parts, dim)
