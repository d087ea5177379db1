"""The search: every factorisation of the GPUs into tp x dp x pp (tp within a node), microbatch counts,
recompute, sequence parallelism and DDP or FSDP, each priced by the cost model, pruned by a lower bound.

Candidates are visited in the order of a lower bound on their step time (their compute spread
perfectly over the pipeline, no communication, no bubble); a candidate is priced only when that
bound could still beat the best layout of its own mesh and the best few meshes found so far, so
the answer is exact while most candidates cost one multiplication.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterator, Optional

from tpcompile.errors import TPCompileError
from tpcompile.strategy.cluster import Cluster
from tpcompile.strategy.cost import STATE_BYTES, Estimate, Layout, estimate
from tpcompile.strategy.decisions import Decision, decide, replicated_units
from tpcompile.strategy.profile import ModelProfile
from tpcompile.strategy.tp_profile import TPProfile

SHOWN = 6  # meshes kept exact: the chosen one and the alternatives the table shows


def simplicity(est: Estimate) -> tuple[bool, float, int]:
    """Sort key: a layout whose tensor parallelism splits something first (est.idle_tp: every tp rank would
    repeat the others' work, which the same GPUs in data parallelism do once), then the step time to 6
    significant digits, then the fewer features (equal times prefer the simpler layout)."""
    lay = est.layout
    extras = (lay.tp > 1) + (lay.pp > 1) + lay.sequence_parallel + lay.recompute + (lay.data_parallel == "fsdp")
    return est.idle_tp, float(f"{est.step_s:.6g}"), extras + len(lay.replicate)


def splits_nothing(tpp: Optional[TPProfile], lay: Layout) -> bool:
    """True for tensor parallelism (tp > 1) that keeps every unit whole: each tp rank computes all of it."""
    return lay.tp > 1 and tpp is not None and set(lay.replicate) >= {u.name for u in tpp.units}


def divisors(n: int) -> list[int]:
    """The positive divisors of n, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_degrees(cluster: Cluster) -> list[int]:
    """Tensor-parallel degrees: divisors of the GPUs of one node (tp stays within a node)."""
    return [t for t in divisors(min(cluster.gpus_per_node, cluster.gpus)) if cluster.gpus % t == 0]


@dataclass
class Result:
    """The priced candidates: the best per mesh (feasible first), and each one's unit decisions."""

    best: Estimate
    per_mesh: list[Estimate]  # the best candidate of each (tp, dp, pp) mesh, fastest first, feasible first
    decisions: dict[Layout, list[Decision]] = field(default_factory=dict)
    priced: int = 0
    considered: int = 0


def candidates(profile: ModelProfile, cluster: Cluster, global_batch: int, training: bool,
               max_pp: Optional[int] = None) -> Iterator[Layout]:
    """Every layout the search considers (pipeline degree at most max_pp), all units split."""
    n = cluster.gpus
    layers = sum(1 for b in profile.blocks if b.repeated)
    for tp in tp_degrees(cluster):
        for pp in divisors(n // tp):
            if pp > len(profile.blocks) or (pp > 1 and layers == 0) or (max_pp is not None and pp > max_pp):
                continue
            dp = n // (tp * pp)
            if global_batch % dp:
                continue
            for m in divisors(global_batch // dp):
                if pp > 1 and m < pp:
                    continue  # 1F1B needs at least one microbatch per stage in flight
                for rc in ((False, True) if training and layers else (False,)):
                    seq_ok = tp > 1 and profile.seq_len > 1  # any length: shares differ by a token at most
                    for sp in ((False, True) if seq_ok else (False,)):
                        for kind in (("ddp", "fsdp") if training and dp > 1 else ("ddp",)):
                            yield Layout(tp, dp, pp, m, rc, sp, kind)


def _lower_bound(profile: ModelProfile, tpp: Optional[TPProfile], cluster: Cluster, lay: Layout,
                 global_batch: int, training: bool) -> tuple[float, float]:
    """(seconds, bytes) no step of this layout beats: its compute spread evenly over the stages, over the
    (m + p - 1) stage times of a 1F1B step; its parameter state spread evenly over the stages."""
    b = global_batch // (lay.dp * lay.microbatches)
    dt = cluster.dtype_bytes
    total, params = 0.0, 0.0
    for i, blk in enumerate(profile.blocks):
        if tpp is None:
            flops, moved, params = blk.flops, blk.moved, params + blk.params
        else:
            bt = tpp.blocks[i]
            flops, moved = bt.flops, bt.moved + bt.moved_whole / (lay.tp if lay.sequence_parallel else 1)
            params += bt.params
        fwd = flops * b / cluster.matmul_rate + moved * b * dt / cluster.memory_bw + blk.ops * cluster.op_overhead
        total += fwd * ((3 if training else 1) + (1 if training and lay.recompute and blk.repeated else 0))
    per_param = (STATE_BYTES / (lay.dp if lay.data_parallel == "fsdp" else 1)) if training else dt
    stage = total / lay.pp + cluster.microbatch_overhead
    # ranks that share cores lend them through the bubble (cost._lend_waits): only the microbatches are sure
    slots = lay.microbatches + (0 if cluster.shared_cores and cluster.gpus > cluster.shared_cores else lay.pp - 1)
    return stage * slots, params / lay.pp * per_param


def search(profile: ModelProfile, tpps: dict[int, TPProfile], cluster: Cluster, global_batch: int,
           training: bool = True, max_pp: Optional[int] = None) -> Result:
    """The fastest layout that fits (pipeline degree at most max_pp), and the best of each mesh."""
    order: list[tuple[float, Layout]] = []
    smallest: Optional[tuple[float, Layout]] = None  # the least state of the layouts that cannot fit
    considered = 0
    for lay in candidates(profile, cluster, global_batch, training, max_pp):
        considered += 1
        seconds, nbytes = _lower_bound(profile, tpps.get(lay.tp), cluster, lay, global_batch, training)
        if nbytes > cluster.usable_memory:  # cannot fit whatever the cut: not worth pricing
            smallest = (nbytes, lay) if smallest is None or nbytes < smallest[0] else smallest
            continue
        order.append((seconds, lay))
    if not order and smallest is not None:
        nbytes, lay = smallest
        raise TPCompileError(
            f"{profile.name} does not fit on {cluster.gpus} GPUs of {cluster.gpu_memory / 1e9:.0f} GB: its weights, "
            f"gradients and optimizer state alone need at least {nbytes / 1e9:.1f} GB per GPU (tp={lay.tp}, "
            f"dp={lay.dp}, pp={lay.pp}, {lay.data_parallel}) of {cluster.usable_memory / 1e9:.1f} GB usable; "
            f"add GPUs or use larger ones")
    if not order:
        raise TPCompileError(f"no layout of {cluster.gpus} GPUs divides the global batch of {global_batch}: "
                             f"make the global batch a multiple of the data-parallel degree (e.g. of "
                             f"{cluster.gpus})")
    order.sort(key=lambda x: x[0])
    best_fit: dict[tuple, Estimate] = {}
    best_any: dict[tuple, Estimate] = {}
    decisions: dict[Layout, list[Decision]] = {}
    memo: dict = {}  # per-block quantities shared between estimates (cost.estimate)
    priced = 0
    for bound, lay in order:
        mesh = lay.mesh
        # a layout that splits nothing ranks last whatever its time, so it prunes nothing
        ranked = sorted(e.step_s for e in best_fit.values() if not e.idle_tp)
        kth = ranked[SHOWN - 1] if len(ranked) >= SHOWN else float("inf")
        own = best_fit[mesh].step_s if mesh in best_fit and not best_fit[mesh].idle_tp else float("inf")
        if bound >= min(own, kth):
            continue
        est, why = _price(profile, tpps.get(lay.tp), cluster, lay, global_batch, training, memo)
        if splits_nothing(tpps.get(lay.tp), est.layout) and est.layout.replicate:
            est, why = _split_all(profile, tpps[lay.tp], cluster, lay, global_batch, training, memo, why)
        est.idle_tp = splits_nothing(tpps.get(lay.tp), est.layout)  # no unit at this degree: ranked last
        priced += 1
        decisions[est.layout] = why
        if est.fits and (mesh not in best_fit or simplicity(est) < simplicity(best_fit[mesh])):
            best_fit[mesh] = est
        if mesh not in best_any or (not est.fits and est.memory < best_any[mesh].memory):
            best_any[mesh] = est
    feasible = sorted(best_fit.values(), key=simplicity)
    rest = sorted((e for m, e in best_any.items() if m not in best_fit), key=lambda e: e.memory)
    if not feasible:
        least = rest[0]
        raise TPCompileError(
            f"{profile.name} does not fit on {cluster.gpus} GPUs of {cluster.gpu_memory / 1e9:.0f} GB: the "
            f"smallest layout found (tp={least.layout.tp}, dp={least.layout.dp}, pp={least.layout.pp}, "
            f"recompute={least.layout.recompute}) needs {least.memory / 1e9:.1f} GB per GPU of "
            f"{cluster.usable_memory / 1e9:.1f} GB usable; add GPUs, lower the global batch or sequence length")
    return Result(feasible[0], feasible + rest, decisions, priced, considered)


def _price(profile: ModelProfile, tpp: Optional[TPProfile], cluster: Cluster, lay: Layout, global_batch: int,
           training: bool, memo: dict | None = None) -> tuple[Estimate, list[Decision]]:
    """The estimate with the cost model's split-or-replicate decisions, or all split when that is better or fits."""
    if tpp is None or lay.tp == 1:
        return estimate(profile, tpp, cluster, lay, global_batch, training, memo), []
    b = global_batch // (lay.dp * lay.microbatches)
    why = decide(profile, tpp, cluster, lay, b, training)
    keep = replicated_units(why)
    split = estimate(profile, tpp, cluster, lay, global_batch, training, memo)
    if not keep:
        return split, why
    mixed = estimate(profile, tpp, cluster, dataclasses.replace(lay, replicate=keep), global_batch, training, memo)
    if mixed.fits and (not split.fits or mixed.step_s <= split.step_s):
        return mixed, why
    resplit = [Decision(d.unit, True, d.saves_s, d.costs_s, f"split: keeping it whole costs more "
                        f"({'memory' if not mixed.fits else 'time'} of the whole layout)", d.paths)
               if d.unit in keep else d for d in why]
    return split, resplit


def _split_all(profile: ModelProfile, tpp: TPProfile, cluster: Cluster, lay: Layout, global_batch: int,
               training: bool, memo: dict, why: list[Decision]) -> tuple[Estimate, list[Decision]]:
    """The layout with every unit split, for a layout the cost model would keep wholly unsplit.

    Tensor parallelism that keeps every unit whole has each tp rank repeat the others' work: cheap on
    paper for a tiny model (no collectives, no gradient sync) but never a use of the GPUs, which data
    parallelism would give work of their own. Priced with its units split, it competes as tensor
    parallelism and loses to data parallelism when its collectives cost more than they save.
    """
    est = estimate(profile, tpp, cluster, dataclasses.replace(lay, replicate=frozenset()), global_batch, training, memo)
    whole = replicated_units(why)
    return est, [Decision(d.unit, True, d.saves_s, d.costs_s, f"split: keeping every unit whole would split "
                          f"nothing at tp {lay.tp}, each rank repeating the others' work ({d.why})", d.paths)
                 if d.unit in whole else d for d in why]
