"""Rewrite helpers for dropout: masks from the per-rank random streams of tpcompile.ops.rng."""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.fx import Node

import tpcompile.ops.rng  # noqa: F401  (registers torch.ops.tpcompile_rng.dropout_mask)
from tpcompile.placement import Shard

aten = torch.ops.aten


def is_live_dropout(node: Node) -> bool:
    """aten.dropout that is on (training, p > 0): its mask must come from a rank stream."""
    if node.target is not aten.dropout.default:
        return False
    p, train = node.args[1], node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    return bool(train) and isinstance(p, (int, float)) and p > 0


def emit_dropout(em: Any, node: Node, lookup: Callable[[Node], Node]) -> Node:
    """x * mask, the mask drawn from the replicated or this rank's own stream."""
    return _masked(em, lookup(node.args[0]), float(node.args[1]), node.meta.get("tp_placement"))


def _masked(em: Any, x: Node, p: float, placement: Any) -> Node:
    stream = "sharded" if isinstance(placement, Shard) else "replicated"
    mask = em.call(torch.ops.tpcompile_rng.dropout_mask.default, x, p, stream, em.ctx.group)
    return em.call(aten.mul.Tensor, x, mask)


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _sdpa_args(node: Node) -> dict:
    out = dict(zip(_SDPA_ARGS, node.args))
    out.update(node.kwargs)
    return out


def sdpa_dropout(node: Node) -> float:
    p = _sdpa_args(node).get("dropout_p", 0.0)
    return float(p) if isinstance(p, (int, float)) else 0.0


def emit_sdpa_with_dropout(em: Any, node: Node, lookup: Callable[[Node], Node]) -> Node:
    """Attention with dropout spelled out, so its mask comes from a rank stream: (B, h, L, S)."""
    a = _sdpa_args(node)
    q, k, v = lookup(a["query"]), lookup(a["key"]), lookup(a["value"])
    if a.get("enable_gqa"):
        raise NotImplementedError("dropout inside grouped-query SDPA")
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
    probs = _masked(em, probs, sdpa_dropout(node), node.meta.get("tp_placement"))
    return em.call(aten.matmul.default, probs, v)
