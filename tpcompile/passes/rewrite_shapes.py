"""The size arguments of a rank graph's op made this rank's: a view's, an expand's or a split's sizes along the split
dim (the rule's `localize` list: divided by the ranks that split it, set to the local value the rule computed, a
padded or cut dim's local size, a token split's share of the tokens)."""
from __future__ import annotations

import operator
from typing import Any, Sequence

import torch
from torch.fx import Node

from tpcompile.layouts import dim_layout
from tpcompile.passes.rewrite_sizes import size_node
from tpcompile.passes.rewrite_tokens import local_flat_tokens, local_tokens
from tpcompile.placement import Shard, is_seq
from tpcompile.sharding_rules.rule_context import to_size

aten = torch.ops.aten


def localize(em: Any, node: Node, locs: Sequence[tuple], p: Any) -> tuple:
    """Divide each named size (a literal, or a run-time size) of the rank graph's `node`, placed `p`, by the ranks
    that split it."""
    args = list(node.args)
    for kind, i, pos, divisor in locs:
        args = _localize_one(em, node, args, kind, i, pos, divisor or em.ws, p)
    return tuple(args)


def _localize_one(em: Any, node: Node, args: list, kind: str, i: int, pos: int, ws: int, p: Any) -> list:
    if kind == "shape":
        sizes = list(args[i])
        if isinstance(p, Shard) and p.padded is not None and p.outer is not None and ws == em.ws \
                and (isinstance(sizes[pos], Node) or sizes[pos] != -1):  # batch x padded heads: outer x local heads
            with em.graph.inserting_before(node):
                outer = size_node(em, p.outer)
                per = dim_layout(p, None, ws).local_size(em.rank)
                sizes[pos] = outer * per if isinstance(outer, int) else em.call(operator.mul, outer, per)
        elif is_seq(p) and ws == em.ws and (isinstance(sizes[pos], Node) or sizes[pos] != -1):
            # this rank's share of the tokens (layouts/token_shares.py); of B sequences' flattened: B times it
            local = local_tokens if p.outer is None else local_flat_tokens
            with em.graph.inserting_before(node):
                sizes[pos] = local(em, em.current.meta["val"].shape[p.dim], p, sizes[pos])
                _spell_inferred(em, sizes)
        elif isinstance(sizes[pos], int) and sizes[pos] != -1:
            local = sum(p.seg_local(ws)) if isinstance(p, Shard) and p.padding else sizes[pos] // ws
            sizes[pos] = local if ws == em.ws else sizes[pos] // ws
        elif isinstance(sizes[pos], Node):
            with em.graph.inserting_before(node):
                sizes[pos] = em.call(operator.floordiv, sizes[pos], ws)
        args[i] = sizes
    elif kind == "split" and node.target is not aten.chunk.default:
        args[i] = [s // ws for s in args[i]] if isinstance(args[i], (list, tuple)) else args[i] // ws
    elif kind == "set":  # the rule computed the local value (segments cut into fewer pieces than ranks)
        args[i] = pos
    elif kind == "shape_set":
        sizes, (at, value) = list(args[i]), pos
        sizes[at] = value
        args[i] = sizes
    return args


def _spell_inferred(em: Any, sizes: list) -> None:
    """A shape's -1 as the size it stands for (a size of the model's inputs), where it can be: next to a rank's
    share of the tokens, which may be 0, a -1 has no one value."""
    val = em.current.meta.get("val")
    if not isinstance(val, torch.Tensor) or len(sizes) != val.dim():
        return
    for j, s in enumerate(sizes):
        if isinstance(s, int) and s == -1:
            try:
                sizes[j] = size_node(em, to_size(val.shape[j]))
            except ValueError:
                pass
