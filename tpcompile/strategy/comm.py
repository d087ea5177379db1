"""Communication time by the alpha-beta model: a latency per ring step plus bytes over the link's bandwidth.

Ring algorithms over p ranks (n: the whole tensor's bytes): all-reduce 2(p-1) steps moving
2(p-1)/p * n per rank; all-gather and reduce-scatter p-1 steps moving (p-1)/p * n.
tpcompile's collectives map to these in forward and backward as their autograd rules say
(docs/architecture.md, "Collectives and gradients"); under sequence parallelism a row split's
all-reduce becomes a reduce-scatter and a column split's entry an all-gather (same bytes,
twice the steps).
"""
from __future__ import annotations

from typing import NamedTuple

from tpcompile.strategy.tp_profile import Collective


class Cost(NamedTuple):
    """Seconds and bytes sent per rank."""

    seconds: float
    sent: float

    def __add__(self, other: "Cost") -> "Cost":  # type: ignore[override]
        return Cost(self.seconds + other.seconds, self.sent + other.sent)

    def times(self, k: float) -> "Cost":
        return Cost(self.seconds * k, self.sent * k)


ZERO = Cost(0.0, 0.0)


def all_reduce(n: float, p: int, bw: float, alpha: float) -> Cost:
    """Ring all-reduce of n bytes over p ranks."""
    if p <= 1 or n <= 0:
        return ZERO  # over one rank (tp = 1) the call only copies
    sent = 2.0 * (p - 1) / p * n
    return Cost(2 * (p - 1) * alpha + sent / bw, sent)


def all_gather(n: float, p: int, bw: float, alpha: float) -> Cost:
    """Ring all-gather (or reduce-scatter) whose whole result is n bytes."""
    if p <= 1 or n <= 0:
        return ZERO  # over one rank (tp = 1) the call only copies
    sent = (p - 1) / p * n
    return Cost((p - 1) * alpha + sent / bw, sent)


reduce_scatter = all_gather


def tp_collective(c: Collective, nbytes: float, p: int, bw: float, alpha: float,
                  sequence_parallel: bool) -> tuple[Cost, Cost]:
    """(forward, backward) cost of one tensor-parallel collective whose per-rank input is `nbytes`."""
    op = c.op
    if sequence_parallel and op == "all_reduce":
        op = "reduce_scatter"
    elif sequence_parallel and op == "grad_all_reduce":
        # the column split's input arrives token-split: gather the tokens, scatter the gradient back
        return all_gather(nbytes, p, bw, alpha), reduce_scatter(nbytes, p, bw, alpha)
    if op == "all_reduce":
        return all_reduce(nbytes, p, bw, alpha), ZERO
    if op in ("grad_all_reduce", "grad_piece_all_reduce", "grad_bucket_all_reduce"):
        # a bucket (the default comm passes) is one backward all-reduce of its members' flattened elements
        return ZERO, all_reduce(nbytes, p, bw, alpha)
    if op == "all_gather":
        return all_gather(nbytes * p, p, bw, alpha), reduce_scatter(nbytes * p, p, bw, alpha)
    if op == "all_gather_replicated":
        return all_gather(nbytes * p, p, bw, alpha), ZERO
    if op == "reduce_scatter":
        return reduce_scatter(nbytes, p, bw, alpha), all_gather(nbytes, p, bw, alpha)
    if op == "scatter":
        return ZERO, all_gather(nbytes, p, bw, alpha)
    return all_reduce(nbytes, p, bw, alpha), ZERO  # an op this table does not know: priced as an all-reduce


def point_to_point(n: float, bw: float, alpha: float) -> Cost:
    """One send of n bytes."""
    return ZERO if n <= 0 else Cost(alpha + n / bw, n)
