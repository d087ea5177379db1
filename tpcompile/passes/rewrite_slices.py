"""This rank's part of a whole value for a split laid out in segments, pieces or batch x heads blocks.

A plain split of a whole value is `tpcompile.scatter` (no communication). For the other layouts
of a split dim (placement.Shard: `segments`, `pieces`, `outer`) the rank's runs are cut with
narrows (and a cat when there are several), after unflattening `outer` repetitions of the
blocks, all without communication. The whole value's gradient is then only this rank's part, so
its source passes `grad_all_reduce` first (identity forward, all-reduce backward), keeping the
invariant that a whole value carries a whole gradient.
"""
from __future__ import annotations

from typing import Any

import sympy
import torch
from torch.fx import Node

from tpcompile.placement import Shard, segment_ranges
from tpcompile.sharding_rules.rule_context import to_size

aten = torch.ops.aten
tp = torch.ops.tpcompile


def local_slice(em: Any, src: Node, node: Node, p: Shard) -> Node:
    """Rank em.rank's part, split as `p`, of the whole value `src` (the rank graph's value of `node`)."""
    val = node.meta["val"]
    if val.is_floating_point() or val.is_complex():
        src = em.call(tp.grad_all_reduce.default, src, em.ctx.group)
    size = to_size(val.shape[p.dim])
    if p.pieces:  # one of `pieces` contiguous pieces, each held by ws / pieces ranks
        n = int(size) // p.pieces
        return em.call(aten.narrow.default, src, p.dim, em.rank // (em.ws // p.pieces) * n, n)
    dim, x = p.dim, src
    block = int(sympy.simplify(sympy.sympify(size) / sympy.sympify(p.outer))) if p.outer is not None else int(size)
    if p.outer is not None:  # (outer * block, ...) -> (outer, block, ...): the runs repeat in every block
        x = em.call(aten.unflatten.int, x, dim, [-1, block])
        dim += 1
    runs = [em.call(aten.narrow.default, x, dim, a, b - a)
            for a, b in segment_ranges(block, p.segments, em.rank, em.ws)]
    x = runs[0] if len(runs) == 1 else em.call(aten.cat.default, runs, dim)
    return em.call(aten.flatten.using_ints, x, dim - 1, dim) if p.outer is not None else x
