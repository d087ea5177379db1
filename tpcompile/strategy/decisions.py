"""Split or replicate, per unit, by the same cost model: a unit whose split saves less time than its collectives cost stays whole.

Splitting a unit over the tp ranks divides its matmuls and memory-bound work by tp and its
parameters (so its share of the optimizer step and of the data-parallel gradient sync); it
costs the unit's collectives every microbatch, forward and backward. Both sides are priced
per training step at the layout's microbatch size.
"""
from __future__ import annotations

from dataclasses import dataclass

from tpcompile.strategy import comm
from tpcompile.strategy.cluster import Cluster
from tpcompile.strategy.cost import GRAD_BYTES, Layout
from tpcompile.strategy.profile import ModelProfile
from tpcompile.strategy.quantities import format_seconds
from tpcompile.strategy.tp_profile import TPProfile, Unit


@dataclass(frozen=True)
class Decision:
    """What one unit does under tensor parallelism, and why."""

    unit: str
    split: bool
    saves_s: float  # per step, by splitting
    costs_s: float  # per step, the split's collectives
    why: str
    paths: tuple[str, ...] = ()


def _unit_times(u: Unit, profile: ModelProfile, cluster: Cluster, lay: Layout, b: int,
                training: bool) -> tuple[float, float]:
    """(seconds saved, seconds of collectives) per step when unit u is split rather than whole."""
    dt = cluster.dtype_bytes
    again = training and lay.recompute and profile.blocks[u.block].repeated
    passes = (3 if training else 1) + (1 if again else 0)
    per_mb = ((u.flops_full - u.flops_rank) * b / cluster.matmul_rate
              + (u.moved_full - u.moved_rank) * b * dt / cluster.memory_bw) * passes
    saved = per_mb * lay.microbatches
    extra = u.params_full - u.params_rank
    if training:
        shard = lay.dp if lay.data_parallel == "fsdp" else 1
        saved += extra * cluster.optimizer_bytes / shard / cluster.memory_bw
        if lay.dp > 1:
            bw, alpha = cluster.link(lay.tp * lay.dp)
            saved += comm.all_reduce(extra * GRAD_BYTES, lay.dp, bw, 0.0).seconds * (1 - cluster.overlap)
    bw, alpha = cluster.link(lay.tp)
    spent = 0.0
    sp = lay.sequence_parallel and lay.tp > 1
    for c in u.collectives:
        f, bk = comm.tp_collective(c, c.elems * b * dt, lay.tp, bw, alpha, sp)
        spent += f.seconds * (2 if again else 1) + (bk.seconds if training else 0.0)
    return saved, spent * lay.microbatches


def _priced(u: Unit, profile: ModelProfile, cluster: Cluster, lay: Layout, b: int,
            training: bool) -> tuple[float, float, str]:
    """(seconds saved, seconds of collectives, why) of splitting unit u."""
    saves, costs = _unit_times(u, profile, cluster, lay, b, training)
    n = len(u.collectives)
    if saves >= costs:
        why = (f"split: saves {format_seconds(saves)} per step, its {n} collective{'s' * (n != 1)} "
               f"cost {format_seconds(costs)}")
    else:
        why = (f"replicated: splitting would save {format_seconds(saves)} per step but its {n} "
               f"collective{'s' * (n != 1)} cost {format_seconds(costs)}")
    return saves, costs, why


def decide(profile: ModelProfile, tpp: TPProfile, cluster: Cluster, lay: Layout, b: int,
           training: bool) -> list[Decision]:
    """One Decision per unit tpcompile split at this degree, and one per module tpcompile kept whole itself."""
    out = []
    priced: dict[tuple, tuple[float, float, str]] = {}  # units alike in what they cost (one per layer) priced once
    for u in tpp.units:
        key = (u.flops_full, u.flops_rank, u.moved_full, u.moved_rank, u.params_full, u.params_rank,
               tuple(u.collectives), profile.blocks[u.block].repeated)
        if key not in priced:
            priced[key] = _priced(u, profile, cluster, lay, b, training)
        saves, costs, why = priced[key]
        out.append(Decision(u.name, saves >= costs, saves, costs, why, u.paths))
    for path, reason in tpp.replicated.items():
        out.append(Decision(path, False, 0.0, 0.0, f"replicated by tpcompile: {reason}", (path,)))
    return out


def replicated_units(decisions: list[Decision]) -> frozenset:
    """The unit names the cost model keeps whole (tpcompile's own replications are not units)."""
    return frozenset(d.unit for d in decisions if not d.split and not d.why.startswith("replicated by"))


def plan_overrides(decisions: list[Decision]) -> dict[str, str]:
    """tpcompile plan= entries for the units kept whole: module path -> 'replicate'."""
    return {p: "replicate" for d in decisions if not d.split and not d.why.startswith("replicated by")
            for p in d.paths}
