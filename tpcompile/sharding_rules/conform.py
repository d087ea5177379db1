"""A rule's placements laid over the tensors they name: pieces carried to a tensor of another size.

A split in pieces (`placement.piece_shard`: kv heads fewer than the ranks, each piece held by several ranks) has
explicit extents, its segment's size and the bounds of its pieces. Rules carry such a split from one tensor to
another whose dim holds as many pieces of another size: attention asks k (2 heads) for the query's 2 pieces of 8
heads, a repeat makes one piece every rank holds whole 4 times as large. `conformed` gives each placement of a
rule's answer (its output, and what it wants of each input) the extents of the tensor it is for: the same pieces
bound to the same ranks. Placements of other kinds are kept as the rule gave them.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import sympy
import torch
from torch.fx import Node

from tpcompile.placement import Shard
from tpcompile.sharding_rules.rule_context import Result, RuleContext, exact_size, sizes_equal, to_size
from tpcompile.sharding_rules.shared_pieces import piece_resized


def conformed(node: Node, res: Result) -> Result:
    """`res` with every split in pieces given the extents of the tensor it is for."""
    val = node.meta.get("val")
    if isinstance(res.out, tuple) and isinstance(val, (tuple, list)) and len(val) == len(res.out):
        out: Any = tuple(_fit(p, v.shape if isinstance(v, torch.Tensor) else None) for p, v in zip(res.out, val))
    else:
        out = _fit(res.out, RuleContext.shape(node))
    wants = [replace(w, placement=fit) if (fit := _fit(w.placement, RuleContext.shape(w.node))) is not w.placement
             else w for w in res.wants]
    if out is res.out and all(a is b for a, b in zip(wants, res.wants)):
        return res
    return replace(res, out=out, wants=wants)


def _fit(p: Any, shape: Any) -> Any:
    """`p` with the extents of a dim of `shape`, when it is in pieces and its segment is another size."""
    if not isinstance(p, Shard) or p.pieces is None or shape is None or p.dim >= len(shape):
        return p
    size = to_size(shape[p.dim])
    inner = size if p.outer is None else exact_size(sympy.sympify(size) / sympy.sympify(p.outer))
    if inner is None or sizes_equal(p.segments[0], inner):
        return p
    if p.pieces == 1 or isinstance(inner, int) and inner % p.pieces == 0:
        return piece_resized(p, inner)
    return p
