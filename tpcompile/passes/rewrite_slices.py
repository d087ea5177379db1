"""Splits laid out in segments, pieces or repeated blocks: this rank's part of a whole value, and the
collectives of tokens flattened with the batch.

A plain split of a whole value is `tpcompile.scatter` (no communication). For the other layouts
of a split dim (placement.Shard: `segments`, `pieces`, `outer`) the rank's runs are cut with
narrows (and a cat when there are several), after unflattening `outer` repetitions of the
blocks, all without communication. The whole value's gradient is then only this rank's part, so
its source passes `grad_all_reduce` first (identity forward, all-reduce backward), keeping the
invariant that a whole value carries a whole gradient.

Under sequence parallelism a (B*T, C) value whose tokens are split is `Shard(0, seq, outer=B)`:
B repetitions of T tokens, each split. Its gathers and reduce-scatters run on the (B, T, C) view
(the size B read off the model input that has it), so each rank's tokens stay in order. Any length
splits: the first T % ws ranks hold one token more (layouts/token_shares.py), and a gather is given T.
"""
from __future__ import annotations

import operator
from typing import Any, Optional

import sympy
import torch
from torch.fx import Node
from torch.utils._sympy.functions import FloorDiv

from tpcompile.layouts import dim_layout, token_shares
from tpcompile.placement import Shard, is_seq
from tpcompile.sharding_rules.padded import zero_padded
from tpcompile.sharding_rules.rule_context import to_size

aten = torch.ops.aten
tp = torch.ops.tpcompile


def local_slice(em: Any, src: Node, node: Node, p: Shard, sync: bool = True, piece: Optional[Shard] = None) -> Node:
    """Rank em.rank's part, split as `p`, of the whole value `src` (the rank graph's value of `node`), or, with
    `piece` (the value in fewer pieces than ranks), of the rank's piece `src`.

    sync=False for a value held in shared pieces whose gradient is summed over the ranks where it is made
    (one piece shared by every rank: multi-query's kv heads, `Shard(pieces=1)`): no grad_all_reduce here."""
    val = node.meta["val"]
    if piece is not None:  # rank r's even block lies in its piece, at its place among the ranks sharing it
        n = int(to_size(val.shape[p.dim])) // em.ws
        return em.call(aten.narrow.default, src, p.dim, em.rank % (em.ws // piece.pieces) * n, n)
    if p.seq and p.outer is not None:  # tokens of every sequence: tpcompile.scatter on the (B, T, ...) view
        x = em.call(tp.scatter.default, unflat_tokens(em, src, p), p.dim + 1, em.plan.group)
        return em.call(aten.flatten.using_ints, x, p.dim, p.dim + 1)
    if sync and (val.is_floating_point() or val.is_complex()):
        src = em.call(tp.grad_all_reduce.default, src, em.plan.group)
    size = to_size(val.shape[p.dim])
    if p.padded is not None or p.rank_cuts or p.seg_padded:  # this rank's piece of each segment, or its block of
        runs = dim_layout(p, int(size), em.ws).runs(em.rank)  # the padded dim, its padding zeros (empty past the end)
        return _blocks(em, src, p.dim, val.dim(), [(start, n, block) for start, _, n, block in runs])
    dim, x = p.dim, src
    block = int(sympy.simplify(sympy.sympify(size) / sympy.sympify(p.outer))) if p.outer is not None else int(size)
    if p.outer is not None:  # (outer * block, ...) -> (outer, block, ...): the runs repeat in every block
        x = em.call(aten.unflatten.int, x, dim, [-1, block])
        dim += 1
    runs = [em.call(aten.narrow.default, x, dim, a, b - a)  # (in pieces: the one of the ranks sharing it)
            for a, b in dim_layout(p, block, em.ws).blocks(em.rank)]
    x = runs[0] if len(runs) == 1 else em.call(aten.cat.default, runs, dim)
    return em.call(aten.flatten.using_ints, x, dim - 1, dim) if p.outer is not None else x


_ARITHMETIC = {sympy.Mul: operator.mul, sympy.Add: operator.add, FloorDiv: operator.floordiv}


def size_node(em: Any, expr: Any) -> Any:
    """A size of the model's inputs (an int, a sympy symbol, or sums, products and floor divisions of them) as a
    value of the rank graph; ValueError when a symbol is no input's size."""
    if isinstance(expr, int) or getattr(expr, "is_number", False):
        return int(expr)
    key = ("size", str(expr))
    if key not in em.cache:
        for ph in em.gm.graph.nodes:
            dims = getattr(ph.meta.get("val"), "shape", ()) if ph.op == "placeholder" else ()
            i = next((i for i, d in enumerate(dims) if isinstance(d, torch.SymInt)
                      and sympy.simplify(d.node.expr - sympy.sympify(expr)) == 0), None)
            if i is not None:
                em.cache[key] = em.call(aten.sym_size.int, em.env[ph], i)
                break
        else:  # sums, products and floor divisions of the inputs' sizes (batch x tokens, patches), made from them
            expr = sympy.sympify(expr)
            op = _ARITHMETIC.get(type(expr))
            if op is None:
                raise ValueError(f"no model input has a dim of size {expr}")
            parts = [size_node(em, a) for a in expr.args]
            out = parts[0]
            for part in parts[1:]:
                out = op(out, part) if isinstance(out, int) and isinstance(part, int) else em.call(op, out, part)
            em.cache[key] = out
    return em.cache[key]


def unflat_tokens(em: Any, x: Node, p: Shard) -> Node:
    """(B*T', ...) -> (B, T', ...) along p.dim, for a token split flattened with the batch (p.outer = B)."""
    return em.call(aten.unflatten.int, x, p.dim, [size_node(em, p.outer), -1])


def _tokens_shape(node: Node, p: Shard, rank_tokens: bool, ws: int) -> tuple:
    shape = [to_size(s) for s in node.meta["val"].shape]
    tokens = sympy.simplify(sympy.sympify(shape[p.dim]) / sympy.sympify(p.outer))
    shape[p.dim:p.dim + 1] = [p.outer, tokens // ws if rank_tokens else tokens]
    return tuple(str(s) for s in shape)


def reduce_scatter_tokens(em: Any, node: Node, y: Node, p: Shard) -> Node:
    """A row split's (B*T, C) sum reduce-scattered by tokens on its (B, T, C) view, flattened back."""
    out = em.call(tp.reduce_scatter.default, unflat_tokens(em, y, p), p.dim + 1, em.plan.group)
    out.meta["tp_shape"] = _tokens_shape(node, p, False, em.ws)
    return em.call(aten.flatten.using_ints, out, p.dim, p.dim + 1)


def gather_tokens(em: Any, src: Node, node: Node, p: Shard, op: Any) -> Node:
    """Every rank's tokens of a token split gathered ((B*T', C): on its (B, T', C) view, flattened back), given the
    whole length when the ranks' shares may differ by one (layouts/token_shares.py)."""
    total = token_total(em, node.meta["val"].shape[p.dim], p)
    size = {} if total is None or isinstance(total, int) and total % em.ws == 0 else {"size": total}
    if p.outer is None:
        return em.call(op, src, p.dim, em.plan.group, **size)
    out = em.call(op, unflat_tokens(em, src, p), p.dim + 1, em.plan.group, **size)
    out.meta["tp_shape"] = _tokens_shape(node, p, True, em.ws)
    return em.call(aten.flatten.using_ints, out, p.dim, p.dim + 1)


def token_total(em: Any, dim_size: Any, p: Shard) -> Any:
    """The tokens of one sequence of a dim of `dim_size` token-split as `p`, as a value of the rank graph (an int,
    or a model input's size); None when no model input has that size."""
    size = to_size(dim_size)
    if p.outer is not None:
        size = sympy.simplify(sympy.sympify(size) / sympy.sympify(p.outer))
    try:
        return size_node(em, size)
    except ValueError:
        return None


def token_share(em: Any, total: Any) -> Any:
    """This rank's share of `total` tokens (an int, or a node of the rank graph): ceil((total - rank) / ws)."""
    if isinstance(total, int):
        return token_shares.share(total, em.rank, em.ws)
    extra = em.ws - 1 - em.rank
    return em.call(operator.floordiv, em.call(operator.add, total, extra) if extra else total, em.ws)


def reduce_partial(em: Any, node: Node, y: Node) -> Node:
    """Sum the ranks' partial results: all-reduce, or reduce-scatter by tokens under SP."""
    p = em.plan.placement(node)
    if is_seq(p) and p.outer is not None:  # (B*T, C): reduce-scattered on its (B, T, C) view
        return reduce_scatter_tokens(em, node, y, p)
    if is_seq(p):
        return em.call(tp.reduce_scatter.default, y, p.dim, em.plan.group)
    return em.call(tp.all_reduce.default, y, em.plan.group)


def zero_padding(em: Any, src: Node, x: Node, *, proven: bool = True) -> Node:
    """x, this rank's value of `src` split with zero padding, with whatever its padding holds made zeros (nothing to
    do when the rank's block has none, or, unless `proven=False`, the padding is known to hold zeros:
    padded.zero_padded). A row split's input: the padding meets the padded columns of its weight, whose gradient
    would be the padding's values (sigmoid(0) = 0.5 after a padded MLP width) and train them away from zero. A
    sum over the padded dim (`proven=False`): its gradient at the padding, 1, would train the padded rows of the
    weight that made it away from zero; the zeroed blocks pass none back."""
    p, val = em.plan.placement(src), src.meta.get("val")
    if not isinstance(p, Shard) or p.padding is None and not p.rank_cuts or p.outer is not None \
            or not isinstance(val, torch.Tensor):
        return x
    runs = dim_layout(p, int(to_size(val.shape[p.dim])), em.ws).runs(em.rank)
    if all(n == block for _, _, n, block in runs) or proven and zero_padded(src, em.plan.placement, rule=em.plan.rule):
        return x
    return _blocks(em, x, p.dim, val.dim(), [(at, n, block) for _, at, n, block in runs])


def _blocks(em: Any, x: Node, dim: int, ndim: int, runs: list[tuple[int, int, int]]) -> Node:
    """Blocks of x along dim joined: per (start, n, block), x's n entries from start, zero-padded to block."""
    tail = [0, 0] * (ndim - 1 - dim)
    parts = []
    for start, n, block in runs:
        if block:  # (an empty piece adds nothing)
            part = em.call(aten.narrow.default, x, dim, start, n)
            parts.append(part if n == block else em.call(aten.constant_pad_nd.default, part, tail + [0, block - n], 0))
    return parts[0] if len(parts) == 1 else em.call(aten.cat.default, parts, dim)
