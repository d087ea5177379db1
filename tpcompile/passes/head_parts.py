"""A fused projection viewed as heads and cut along them into runs of whole heads: q | k | v of multi-query
attention (Falcon's `qkv[..., :-2, :]`, `qkv[..., [-2], :]`, `qkv[..., [-1], :]`, or one split_with_sizes of the
heads into [heads, 1, 1]). The annotate pass reads the runs as the projection's segments."""
from __future__ import annotations

import operator
from typing import Optional

import torch
from torch.fx import Node

from tpcompile.sharding_rules import RuleSpec
from tpcompile.sharding_rules.table import lookup


def head_parts(reshape: Node, width: int) -> Optional[tuple[tuple[int, ...], list[Optional[Node]]]]:
    """(.., width) viewed as (.., n, d) and cut along n into runs of whole heads by slices and constant picks
    (Falcon's multi-query `qkv[..., :-2, :]`, `qkv[..., [-2], :]`, `qkv[..., [-1], :]`): each run's width in
    features, and the value holding it."""
    shape = reshape.meta["val"].shape
    if len(shape) < 2 or not all(isinstance(v, int) for v in shape[-2:]) or shape[-2] * shape[-1] != width:
        return None
    n, d, dim = int(shape[-2]), int(shape[-1]), len(shape) - 2
    runs: dict[tuple[int, int], Node] = {}
    for u in reshape.users:
        if u.target is torch.ops.aten.slice.Tensor and len(u.args) > 1 and u.args[1] % len(shape) == dim:
            args = list(u.args) + [None] * (5 - len(u.args))
            ends = [0 if args[2] is None else args[2], n if args[3] is None else args[3]]
            if args[4] not in (None, 1) or not all(isinstance(e, int) for e in ends):
                return None
            runs[tuple(min(n, e + n if e < 0 else e) for e in ends)] = u
        elif u.target is torch.ops.aten.index.Tensor and [i is None for i in u.args[1]] == [True] * dim + [False]:
            pos = (u.meta.get("tp_rule") or RuleSpec("index", {})).get("positions")
            at = sorted({p % n for p in pos}) if pos else []
            if not at or at != list(range(at[0], at[-1] + 1)):
                return None
            runs[(at[0], at[-1] + 1)] = u
        elif split_along(u, dim, len(shape)):  # split_with_sizes of the heads (Falcon's [heads, 1, 1] in 5.25)
            got = {g.args[1]: g for g in u.users if g.target is operator.getitem}
            start = 0
            for i, part in enumerate(u.meta["val"]):
                if i not in got:
                    return None
                runs[(start, start + int(part.shape[dim]))], start = got[i], start + int(part.shape[dim])
        else:
            return None
    bounds = sorted(runs)
    if len(bounds) < 2 or bounds[0][0] != 0 or bounds[-1][1] != n or any(a[1] != b[0] for a, b in zip(bounds,
                                                                                                   bounds[1:])):
        return None
    return tuple((b - a) * d for a, b in bounds), [runs[b] for b in bounds]


def split_along(u: Node, dim: int, ndim: int) -> bool:
    """True when u is a split (split / split_with_sizes / chunk) of its input along dim."""
    spec = lookup(u.target) if u.op == "call_function" else None
    at = u.args[2] if len(u.args) > 2 else u.kwargs.get("dim", 0)
    return spec is not None and spec.rule == "split" and isinstance(u.meta.get("val"), (list, tuple)) \
        and isinstance(at, int) and at % ndim == dim
