"""Pipeline stages: consecutive pieces grouped so the stages cost about the same, and what each stage passes on.

A piece's cost is its parameter bytes times four (the parameter, its gradient and AdamW's two
moments) plus its activation bytes at the captured example shape (every value it computes, as
kept for backward). Stages are contiguous runs of pieces minimising the largest stage cost.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

from tpcompile.errors import TPCompileError
from tpcompile.hybrid.pieces import Piece

# parameter, gradient, and AdamW's exp_avg and exp_avg_sq: the bytes a trained parameter costs
STATE_COPIES = 4


def _hint(size: Any) -> int:
    """A dim's size at the example inputs (symbolic sizes by their hint)."""
    if isinstance(size, int):
        return size
    hint = getattr(size.node, "hint", None)
    return int(hint) if hint is not None else 1  # a size without a hint counts as 1


def _bytes(val: Any) -> int:
    """Bytes of one (fake) tensor at the example shape; 0 for anything else."""
    if not isinstance(val, torch.Tensor):
        return 0
    n = 1
    for s in val.shape:
        n *= _hint(s)
    return n * val.element_size()


def piece_cost(piece: Piece) -> int:
    """Parameter bytes x STATE_COPIES plus activation bytes of one piece."""
    params = {id(t): t for _, t in piece.gm.named_parameters()} if piece.gm is not None else {}
    weights = sum(t.numel() * t.element_size() for t in params.values())
    acts = sum(_bytes(n.meta.get("val")) for n in piece.nodes)
    return STATE_COPIES * weights + acts


def balanced_split(costs: list[int], n_stages: int) -> list[int]:
    """The number of pieces in each of `n_stages` contiguous non-empty groups, minimising the largest sum."""
    n = len(costs)
    if n_stages > n:
        raise TPCompileError(f"{n_stages} pipeline stages need at least {n_stages} pieces, but the model splits "
                             f"into {n} (its repeated blocks plus the code before and after them); use fewer "
                             f"stages (pp, or schedule='1F1B' instead of an interleaved one) or a deeper model")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest largest-stage cost of the first i pieces in k stages
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0
    for k in range(1, n_stages + 1):
        for i in range(k, n - (n_stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    sizes, i = [], n
    for k in range(n_stages, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def group_pieces(pieces: list[Piece], n_stages: int) -> list[list[Piece]]:
    """The pieces in `n_stages` balanced contiguous stages."""
    sizes = balanced_split([piece_cost(p) for p in pieces], n_stages)
    out, start = [], 0
    for s in sizes:
        out.append(pieces[start:start + s])
        start += s
    return out


def stage_io(stages: list[list[Piece]], inputs: list[Node], outputs: list[Node]) -> list[tuple[list[Node], list[Node]]]:
    """(inputs, outputs) of every stage: stage 0 takes the model inputs, the last returns the model outputs,
    and each boundary carries every value produced before it and used after it (passed on through
    intermediate stages)."""
    made: dict[Node, int] = {n: 0 for n in inputs}
    last = len(stages) - 1
    used: dict[Node, int] = {n: last for n in outputs}
    order: dict[Node, int] = {n: i for i, n in enumerate(inputs)}
    for s, group in enumerate(stages):
        for p in group:
            for o in p.outputs:
                made.setdefault(o, s)
                order.setdefault(o, len(order))
            for i in p.inputs:
                used[i] = max(used.get(i, s), s)
                if i not in made:
                    raise TPCompileError(f"stage {s} needs {i.name}, which no earlier piece computes; this is a "
                                         f"split bug, please report it with the model")
    io = []
    prev: list[Node] = list(inputs)
    for s in range(len(stages)):
        if s == last:
            outs = list(outputs)
        else:
            outs = sorted((v for v in made if made[v] <= s and used.get(v, -1) > s), key=order.__getitem__)
        io.append((prev, outs))
        prev = outs
    return io
