"""Ops a fused projection's features pass through unchanged, channels first: what annotate's search for the
sizes a projection's output is split into (passes/annotate.py, `_segment_parts`) may walk past."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.fx import Node

from tpcompile.sharding_rules import lookup


def keeps_features(nxt: Node, cur: Node, fdim: int) -> bool:
    """True when `nxt` keeps the features of `cur` at dim `fdim`, each where it was: an elementwise op, a slice of
    another dim, or a depthwise convolution over them as channels (the short convolution of linear attention)."""
    a, b = cur.meta.get("val"), nxt.meta.get("val")
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.dim() != b.dim() \
            or a.shape[fdim] != b.shape[fdim] or nxt.args[0] is not cur:
        return False
    spec = lookup(nxt.target)
    if spec is not None and spec.rule == "pointwise":
        return True
    if nxt.target is torch.ops.aten.slice.Tensor:
        return (nxt.args[1] if len(nxt.args) > 1 else 0) % a.dim() != fdim
    if spec is None or spec.rule != "weight_conv" or fdim != 1:
        return False
    i = spec.get("groups_arg")
    return (nxt.args[i] if i < len(nxt.args) else 1) == a.shape[1]


def nested(sizes: tuple, parts: list[Optional[Node]], fdim: int, walk: Callable[..., Any]) -> tuple[tuple, list]:
    """The sizes a projection's output is split into, each part split again further on replaced by its own parts
    (Mamba-2's x|B|C, one part of z|xBC|dt, split after the depthwise convolution over it)."""
    out_sizes: list = []
    out_parts: list[Optional[Node]] = []
    for size, part in zip(sizes, parts):
        sub = walk(part, size, fdim, True) if part is not None else None
        if sub and sum(sub[0]) == size:
            out_sizes += sub[0]
            out_parts += sub[1]
        else:
            out_sizes.append(size)
            out_parts.append(part)
    return tuple(out_sizes), out_parts
