"""Each rank's outputs against the original model's: a tolerance scaled to the output, split outputs by slice.

The allowed difference of one output is atol + rtol * max|reference|, with torch.testing.assert_close's
defaults for the output's dtype: a sharded sum adds the same terms in another order, so its rounding
error grows with the size of the values, not with a fixed absolute amount. An output the plan leaves
split (`sharded_output`) is compared rank by rank with the slice of the reference that rank holds.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch.utils import _pytree as pytree

from tpcompile.placement import Shard, local_shape, rank_pieces
from tpcompile.report.tolerance import Tolerance
from tpcompile.report.wording import placements_in_words

# dtype -> (atol, rtol), as torch.testing.assert_close chooses them
DEFAULT_TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float16: (1e-5, 1e-3), torch.bfloat16: (1e-5, 1.6e-2), torch.float32: (1e-5, 1.3e-6),
    torch.float64: (1e-7, 1e-7), torch.complex64: (1e-5, 1.3e-6), torch.complex128: (1e-7, 1e-7),
}


@dataclass
class OutputCheck(Tolerance):
    """One output tensor: its difference from the reference on every rank, and what is allowed."""

    path: str
    shape: tuple[int, ...]
    diffs: list[float]  # per rank, largest |difference|
    scale: float  # max |reference|
    atol: float
    rtol: float
    split: str = ""  # how the output stays split across ranks, in words; '' when every rank holds all of it

    @property
    def relative(self) -> float:
        return self.worst / self.scale if self.scale else (0.0 if self.worst == 0 else math.inf)

    @property
    def ok(self) -> bool:
        return self.worst <= self.allowed


def leaves(value: Any, path: str = "output") -> list[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor in a nest of tuples, lists and mappings (model output classes too)."""
    if isinstance(value, torch.Tensor):
        return [(path, value)]
    if isinstance(value, Mapping):
        return [x for k, v in value.items() for x in leaves(v, f"{path}.{k}" if path != "output" else str(k))]
    if isinstance(value, (tuple, list)):
        return [x for i, v in enumerate(value) for x in leaves(v, f"{path}[{i}]")]
    return []


def output_placements(sharded: Any, count: int) -> list[Optional[Any]]:
    """The placement of each tensor output of the sharded graphs (None: every rank holds all of it)."""
    out = next(n for n in sharded.captured.graph.nodes if n.op == "output")
    nodes = [n for n in pytree.tree_leaves(out.args[0])
             if isinstance(n, torch.fx.Node) and isinstance(n.meta.get("val"), torch.Tensor)]
    if len(nodes) != count:  # outputs the graph does not return as tensors: compare whole
        return [None] * count
    return [p if isinstance(p := sharded.decisions.placement(n), Shard) else None for n in nodes]


def tolerance(dtype: torch.dtype, atol: Optional[float], rtol: Optional[float]) -> tuple[float, float]:
    """The (atol, rtol) for an output of `dtype`: the given ones, else assert_close's; exact for integers."""
    base = DEFAULT_TOLERANCE.get(dtype, (0.0, 0.0))
    return (base[0] if atol is None else atol, base[1] if rtol is None else rtol)


def _rank_diff(ref: torch.Tensor, got: Optional[torch.Tensor], placement: Optional[Shard], rank: int,
               world_size: int) -> tuple[float, bool]:
    """Largest |difference| of one rank's output from the reference, or from its slice of it when the rank
    holds only a slice; and whether it was a slice."""
    if got is None:
        return math.inf, False
    ref, got = ref.detach().double(), got.detach().double()
    if got.shape == ref.shape:  # gathered (or never split): the whole output
        return (float((ref - got).abs().max()) if ref.numel() else 0.0), False
    if (placement is None or placement.outer is not None or placement.split_next
            or tuple(got.shape) != local_shape(ref.shape, placement, rank, world_size)):
        return math.inf, False
    d, worst = placement.dim, 0.0
    for start, local, n in rank_pieces(placement, ref.shape[d], rank, world_size):
        piece = (ref.narrow(d, start, n) - got.narrow(d, local, n)).abs()
        worst = max(worst, float(piece.max()) if piece.numel() else 0.0)
    return worst, True


def check_outputs(expected: Any, per_rank: Sequence[Any], sharded: Any, *, atol: Optional[float] = None,
                  rtol: Optional[float] = None) -> list[OutputCheck]:
    """One OutputCheck per output tensor of the original model; an output a rank lacks counts as infinite."""
    ref = leaves(expected)
    ranks = [leaves(o) for o in per_rank]
    placements = output_placements(sharded, len(ref))
    checks = []
    for k, (path, t) in enumerate(ref):
        p = placements[k]
        found = [_rank_diff(t, out[k][1] if len(out) == len(ref) else None, p, r, len(per_rank))
                 for r, out in enumerate(ranks)]
        a, r = tolerance(t.dtype, atol, rtol)
        scale = float(t.detach().double().abs().max()) if t.numel() else 0.0
        split = placements_in_words(str(p)) if p is not None and any(sliced for _, sliced in found) else ""
        checks.append(OutputCheck(path, tuple(t.shape), [d for d, _ in found], scale, a, r, split))
    return checks
