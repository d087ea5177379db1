"""Zero-padded splits through reshapes: a projection padded by whole heads, viewed as (heads, head_dim) and back.

A column split whose output size the world size does not divide is zero-padded to a multiple of it
(`Shard(dim, padded=N)`); when a reshape splits that output into heads, the padding goes by whole heads
(sharding_rules/matmul.py), so the heads dim carries the padding and each rank holds whole heads.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

from tpcompile.placement import Shard
from tpcompile.sharding_rules.rule_context import Size, prod


def padded_reshape(p: Shard, gi: Sequence[int], gj: Sequence[int], ins: Sequence[Size], outs: Sequence[Size],
                   ws: int) -> tuple[Optional[Shard], str]:
    """A zero-padded split through a reshape: (heads * d) padded by whole heads <-> (heads, d), and back.

    The padded dim must lead its group of dims (nothing folded before it), and each rank's block of the padded
    elements must hold whole entries of the output dim that carries it: that dim is then padded the same way.
    """
    why = f"reshape of a dim padded from {ins[p.dim]} to {p.padded} cuts through the padding"
    if p.segments or p.outer or p.pieces or p.seg_pieces or p.split_next or p.seq or gi[0] != p.dim:
        return None, why
    inner = prod([ins[d] for d in gi[1:]])
    real, full = ins[p.dim], p.padded
    if not isinstance(inner, int) or not isinstance(real, int):
        return None, why
    for u, d in enumerate(gj):
        if prod([outs[e] for e in gj[:u]]) != 1 or outs[d] == 1:
            continue
        q = prod([outs[e] for e in gj[u + 1:]])
        if not isinstance(q, int) or (real * inner) % q or (full * inner) % (ws * q):
            return None, why
        return replace(p, dim=d, padded=full * inner // q), ""
    return None, why
