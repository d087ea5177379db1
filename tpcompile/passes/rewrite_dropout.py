"""Rewrite helpers for dropout: masks of tpcompile.ops.rng, told where this rank's elements lie in the whole tensor.

The mask op hashes each element's global position (ops/rng.py), so the rewrite gives it, from the
node's placement, the runs of global positions this rank holds along the split dim (segments of a
fused q|k|v, pieces of kv heads, a padded vocabulary, heads folded with the batch, tokens under
sequence parallelism), and which dims are multiples of the batch, whose global rows the runtime
gives (`rng.rows`). Attention with dropout is spelled out so that its probabilities get such a mask.
"""
from __future__ import annotations

import operator
from typing import Any, Callable, Optional, Sequence

import sympy
import torch
from torch.fx import Node

import tpcompile.ops.rng as rng
from tpcompile.layouts import block_of, dim_layout, holders
from tpcompile.passes.rewrite_sizes import size_node
from tpcompile.passes.rewrite_tokens import token_total
from tpcompile.placement import REPLICATE, Shard, segment_ranges
from tpcompile.sharding_rules.rule_context import to_size

aten = torch.ops.aten


def is_live_dropout(node: Node) -> bool:
    """aten.dropout that is on (training, p > 0): its mask must come from tpcompile.ops.rng."""
    if node.target is not aten.dropout.default:
        return False
    p, train = node.args[1], node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    return bool(train) and isinstance(p, (int, float)) and p > 0


def is_idle_dropout(node: Node) -> bool:
    """aten.dropout that is off (captured in eval mode, or p = 0): the identity, which the rank graphs leave out."""
    if node.target is not aten.dropout.default:
        return False
    p, train = node.args[1], node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    return train is False or (isinstance(p, (int, float)) and p == 0)


def emit_dropout(em: Any, node: Node, lookup: Callable[[Node], Node]) -> Node:
    """x * mask, each element's decision drawn from its position in the whole tensor."""
    shape = list(node.meta["val"].shape)
    return _masked(em, lookup(node.args[0]), float(node.args[1]), node.name, shape, em.plan.placement(node))


def _masked(em: Any, x: Node, p: float, site: str, shape: Sequence[Any], placement: Any) -> Node:
    """x times the mask of site `site` for a value of global `shape` laid out as `placement` on em.rank."""
    split = split_spec(em, placement, shape)
    rows_of, batch = _rows(em, placement, shape)
    mask = em.call(torch.ops.tpcompile_rng.dropout_mask.default, x, p, site, em.rank, split, rows_of, batch)
    return em.call(aten.mul.Tensor, x, mask)


def split_spec(em: Any, placement: Any, shape: Sequence[Any]) -> list:
    """dropout_mask's `split` list: where em.rank's positions lie along the dims `placement` splits."""
    if not isinstance(placement, Shard):
        return []
    d, rank, ws = placement.dim, em.rank, em.ws
    if placement.within is not None:  # a row of dim d, the rank's piece of its dim d+1: one run of the two merged
        rows, nxt = int(to_size(shape[d])) // placement.pieces, int(to_size(shape[d + 1]))
        assert rows == 1, f"{placement}: {rows} rows of dim {d} a rank, each cut along dim {d + 1}, are not one run"
        layout = dim_layout(placement, None, ws)
        return [d, rng.MERGED, layout.piece(layout.segments[0], rank) * nxt + layout.within_run(rank)[0], nxt]
    block = sympy.sympify(block_of(to_size(shape[d]), placement.outer))
    if placement.seq or not block.is_number:  # tokens (a run-time size) in their shares, in `outer` blocks
        reps = 1 if placement.outer is None else size_node(em, placement.outer)
        found = token_total(em, shape[d], placement) if placement.seq else None
        total, inner = (0, 1) if found is None else found
        return [d, rng.EVEN, rank, ws, reps, total, inner]
    block = int(block)
    if placement.pieces:  # one of `pieces` pieces, shared by `holders` ranks
        n = block // placement.pieces
        k = rank // holders(ws, placement.pieces)
        runs = [(k * n, (k + 1) * n)]
    elif placement.cuts is not None:  # this rank's piece of each segment, from the segment's start (the positions
        layout, runs, start = dim_layout(placement, None, ws), [], 0  # of its zeros run on: their values stay zero)
        for seg in layout.segments:
            k = layout.piece(seg, rank)
            if seg.cuts[k + 1] > seg.cuts[k]:
                runs.append((start + seg.cuts[k], start + seg.cuts[k + 1]))
            start += seg.size
    else:
        runs = segment_ranges(placement.padded or block, placement.segments, rank, ws)
    return [d, rng.RUNS, block, len(runs), *[v for run in runs for v in run]]


def _divides(b: Any, size: Any) -> bool:
    """True when the size is a whole multiple of the batch b (a symbolic size)."""
    if size is None:
        return False
    ratio = sympy.simplify(sympy.sympify(size) / b)
    return sympy.fraction(ratio)[1] == 1 and ratio != 0


def _rows(em: Any, placement: Any, shape: Sequence[Any]) -> tuple[list[int], Any]:
    """Per dim, 1 where its size (a split dim's `outer` repetitions) is a multiple of the batch; the batch size."""
    if ("batch_symbol",) not in em.cache:
        em.cache[("batch_symbol",)] = batch_symbol(em.gm)
    b = em.cache[("batch_symbol",)]
    if b is None:
        return [0] * len(shape), 0
    flags = []
    for d, s in enumerate(shape):
        if isinstance(placement, Shard) and d == placement.dim:
            flags.append(int(not placement.split_next and _divides(b, placement.outer)))
        elif isinstance(placement, Shard) and placement.split_next and d == placement.dim + 1:
            flags.append(0)
        else:
            flags.append(int(_divides(b, to_size(s))))
    return flags, size_node(em, b) if any(flags) else 0


def batch_symbol(gm: Any) -> Optional[sympy.Expr]:
    """The batch size: dim 0 of the graph's first tensor input whose dim 0 is symbolic (what microbatches split)."""
    for ph in gm.graph.find_nodes(op="placeholder"):
        val = ph.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() > 0:
            b = to_size(val.shape[0])
            if not isinstance(b, int):
                return b
    return None


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _sdpa_args(node: Node) -> dict:
    out = dict(zip(_SDPA_ARGS, node.args))
    out.update(node.kwargs)
    return out


def sdpa_dropout(node: Node) -> float:
    """The dropout probability of a scaled_dot_product_attention node (0 when off)."""
    p = _sdpa_args(node).get("dropout_p", 0.0)
    return float(p) if isinstance(p, (int, float)) else 0.0


def emit_sdpa_with_dropout(em: Any, node: Node, lookup: Callable[[Node], Node]) -> Node:
    """Attention with dropout spelled out, so its probabilities (B, h, L, S) get a layout-independent mask."""
    a = _sdpa_args(node)
    q, k, v = lookup(a["query"]), lookup(a["key"]), lookup(a["value"])
    if a.get("enable_gqa"):  # each kv head serves a run of query heads, as SDPA's repeat_interleave does
        k, v = (_repeat_heads(em, q, t) for t in (k, v))
    head_dim = int(a["query"].meta["val"].shape[-1])
    scale = a.get("scale") or head_dim ** -0.5
    scores = em.call(aten.mul.Scalar, em.call(aten.matmul.default, q, em.call(aten.transpose.int, k, -2, -1)), scale)
    if a.get("is_causal"):
        ones = em.call(aten.ones_like.default, scores, dtype=torch.bool)
        keep = em.call(aten.tril.default, ones)
        scores = em.call(aten.masked_fill.Scalar, scores, em.call(aten.logical_not.default, keep), float("-inf"))
    mask = a.get("attn_mask")
    if isinstance(mask, Node):
        m = lookup(mask)
        if mask.meta["val"].dtype == torch.bool:
            scores = em.call(aten.masked_fill.Scalar, scores, em.call(aten.logical_not.default, m), float("-inf"))
        else:
            scores = em.call(aten.add.Tensor, scores, m)
    probs = em.call(aten.softmax.int, scores, -1)
    q_shape, k_shape = list(a["query"].meta["val"].shape), list(a["key"].meta["val"].shape)
    shape = q_shape[:-1] + [k_shape[-2]]
    placement = em.plan.placement(node)
    if isinstance(placement, Shard) and placement.dim == len(shape) - 1:  # the value's features: probs are whole
        placement = REPLICATE
    probs = _masked(em, probs, sdpa_dropout(node), node.name, shape, placement)
    return em.call(aten.matmul.default, probs, v)


def _repeat_heads(em: Any, q: Node, kv: Node) -> Node:
    """kv's heads repeated to q's count on this rank (its heads or its kv piece): (B, hkv, S, E) -> (B, h, S, E)."""
    n = em.call(operator.floordiv, em.call(aten.sym_size.int, q, -3), em.call(aten.sym_size.int, kv, -3))
    return em.call(aten.repeat_interleave.self_int, kv, n, -3)
