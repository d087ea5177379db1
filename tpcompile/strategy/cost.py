"""The cost model: predicted step time, memory per GPU and communication per mesh dim of one layout.

Per block and microbatch: compute by roofline (matmul FLOPs at the cluster's matmul rate,
memory-bound elements at its memory bandwidth, an overhead per op), backward twice forward,
recompute one more forward of the repeated blocks; tensor-parallel collectives by alpha-beta
(comm.py), not overlapped. The chain is cut into pipeline stages (block_graph.partition); a 1F1B
step takes (m + p - 1) x the slowest stage, i.e. m stage times plus the bubble (p - 1) / m of
them; ranks that share cores (`shared_cores`, this machine) lend them to the others while they
wait in the bubble or on a slower stage. Data-parallel gradient sync (DDP all-reduce, or FSDP
all-gathers and reduce-scatter) hides behind compute up to the cluster's `overlap`; the optimizer
step moves `optimizer_bytes` per local parameter and runs `optimizer_ops` ops per tensor. Memory
per GPU: 16 B per parameter (mixed-precision Adam: weights, gradients, two moments and the master
copy) divided by the FSDP degree, FSDP's unsharded working set, and the activations of the
microbatches in flight (divided by tp under sequence parallelism).
"""
from __future__ import annotations

import functools

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from tpcompile.strategy import comm
from tpcompile.strategy.block_graph import Partition, block_graph, partition
from tpcompile.strategy.cluster import Cluster
from tpcompile.strategy.profile import ModelProfile
from tpcompile.strategy.tp_profile import Collective, TPProfile

if TYPE_CHECKING:
    import networkx as nx

STATE_BYTES = 16  # per parameter: bf16 weight and gradient, fp32 master weight and two Adam moments
GRAD_BYTES = 4  # gradients are reduced in fp32
FSDP_PREFETCH = 2  # FSDP holds the current block's gathered weights and prefetches the next


@dataclass(frozen=True)
class Layout:
    """One point of the search space."""

    tp: int
    dp: int
    pp: int
    microbatches: int
    recompute: bool = False
    sequence_parallel: bool = False
    data_parallel: str = "ddp"  # fsdp | ddp
    replicate: frozenset = frozenset()  # units kept whole under tp

    @property
    def mesh(self) -> tuple[int, int, int]:
        return self.tp, self.dp, self.pp


@dataclass
class Estimate:
    """What the cost model predicts for a layout."""

    layout: Layout
    micro_batch: int
    step_s: float
    memory: float  # bytes on the fullest GPU
    fits: bool
    time: dict[str, float] = field(default_factory=dict)  # parts of step_s
    comm: dict[str, float] = field(default_factory=dict)  # bytes sent per GPU and step, by mesh dim
    memory_parts: dict[str, float] = field(default_factory=dict)  # of the fullest GPU
    stages: tuple[tuple[int, int], ...] = ()
    graph: Optional[nx.DiGraph] = None
    idle_tp: bool = False  # tp > 1 with every unit kept whole (search.splits_nothing): ranked after the rest


@dataclass
class _Blocks:
    """Per-block quantities of one layout at its microbatch size (lists indexed by block)."""

    time: list[float]
    compute: list[float]
    tp_s: list[float]
    tp_bytes: list[float]
    params: list[float]  # elements per rank
    tensors: list[int]
    act: list[float]  # bytes per microbatch kept for backward without recompute
    inp: list[float]  # bytes per microbatch kept for backward with recompute (the block's input)
    send_bytes: list[float]
    send_s: list[float]
    repeated: list[bool]


def _blocks(profile: ModelProfile, tpp: Optional[TPProfile], cluster: Cluster, lay: Layout, b: int,
            training: bool) -> _Blocks:
    """Each block's time, bytes and parameters on one rank for one microbatch of b samples."""
    t, sp, dt = lay.tp, lay.sequence_parallel and lay.tp > 1, cluster.dtype_bytes
    tp_bw, tp_alpha = cluster.link(t)
    pp_bw, pp_alpha = cluster.link(lay.tp * lay.dp * lay.pp) if lay.pp > 1 else (1.0, 0.0)
    units: dict[int, list] = {}  # block -> its units, in tpp.units order
    for u in tpp.units if tpp is not None else ():
        units.setdefault(u.block, []).append(u)
    out = _Blocks(*([] for _ in range(11)))  # type: ignore[arg-type]
    for i, blk in enumerate(profile.blocks):
        if tpp is None:
            flops, moved, params, act, colls = blk.flops, blk.moved, float(blk.params), blk.act, []
        else:
            bt = tpp.blocks[i]
            flops, moved, params = bt.flops, bt.moved + bt.moved_whole / (t if sp else 1), float(bt.params)
            act = bt.act_split + bt.act_whole / (t if sp else 1)
            colls = list(bt.collectives)
            for u in units.get(i, ()):
                if u.name in lay.replicate:
                    flops += u.flops_full - u.flops_rank
                    moved += u.moved_full - u.moved_rank
                    params += u.params_full - u.params_rank
                    act += u.act_full - u.act_rank
                else:
                    colls += u.collectives
        fwd = flops * b / cluster.matmul_rate + moved * b * dt / cluster.memory_bw + blk.ops * cluster.op_overhead
        again = training and lay.recompute and blk.repeated
        compute = fwd * ((3 if training else 1) + (1 if again else 0))
        f_comm, b_comm = _collectives(colls, b * dt, t, tp_bw, tp_alpha, sp)
        tp_cost = f_comm + (b_comm if training else comm.ZERO) + (f_comm if again else comm.ZERO)
        send = blk.out * b * dt / (t if sp else 1)
        hop = comm.point_to_point(send, pp_bw, pp_alpha).times(2 if training else 1)
        out.time.append(compute + tp_cost.seconds)
        out.compute.append(compute)
        out.tp_s.append(tp_cost.seconds)
        out.tp_bytes.append(tp_cost.sent)
        out.params.append(params)
        out.tensors.append(len(blk.param_names))
        out.act.append(act * b * dt)
        out.inp.append(blk.inp * b * dt / (t if sp else 1))
        out.send_bytes.append(send)
        out.send_s.append(hop.seconds if lay.pp > 1 else 0.0)
        out.repeated.append(blk.repeated)
    return out


def _collectives(colls: list[Collective], scale: float, t: int, bw: float, alpha: float,
                 sp: bool) -> tuple[comm.Cost, comm.Cost]:
    """Forward and backward cost of a block's collectives for one microbatch (scale: bytes per element-sample)."""
    fwd, bwd = comm.ZERO, comm.ZERO
    for c in colls:
        f, b = comm.tp_collective(c, c.elems * scale, t, bw, alpha, sp)
        fwd, bwd = fwd + f, bwd + b
    return fwd, bwd


def _stage_memory(blocks: _Blocks, cluster: Cluster, lay: Layout, training: bool):
    """(i, j, s) -> bytes on a GPU of stage s running blocks i..j-1 by part (a dict), and (i, j, s) -> their total."""
    dt = cluster.dtype_bytes
    worst_recompute = max((a for a, r in zip(blocks.act, blocks.repeated) if r), default=0.0)
    names = ("states", "fsdp_gathered", "activations") if training else ("weights", "activations")

    @functools.cache
    def of_range(i: int, j: int) -> tuple[float, ...]:  # what does not depend on the stage
        params = sum(blocks.params[i:j])
        if not training:
            return params * dt, max(blocks.act[i:j], default=0.0)
        fsdp = lay.data_parallel == "fsdp" and lay.dp > 1
        states = params * STATE_BYTES / (lay.dp if fsdp else 1)
        gathered = 0.0
        if fsdp:
            # between microbatches the schedule keeps the stage's weights gathered and its gradients whole (no
            # reshard, no reduce-scatter until the last); one microbatch without pipelining holds two blocks
            if lay.pp > 1 or lay.microbatches > 1:
                gathered = params * (dt + GRAD_BYTES)
            else:
                gathered = FSDP_PREFETCH * max(blocks.params[i:j]) * dt
        if lay.recompute:
            kept = sum(blocks.inp[k] if blocks.repeated[k] else blocks.act[k] for k in range(i, j))
            working = worst_recompute if any(blocks.repeated[i:j]) else 0.0
        else:
            kept, working = sum(blocks.act[i:j]), 0.0
        return states, gathered, kept, working

    def values(i: int, j: int, s: int) -> tuple[float, ...]:
        got = of_range(i, j)
        if not training:
            return got
        states, gathered, kept, working = got
        inflight = min(lay.microbatches, lay.pp - s) if lay.pp > 1 else 1
        return states, gathered, kept * inflight + working

    def parts(i: int, j: int, s: int) -> dict[str, float]:
        return dict(zip(names, values(i, j, s)))

    def total(i: int, j: int, s: int) -> float:
        return sum(values(i, j, s))

    return parts, total


def estimate(profile: ModelProfile, tpp: Optional[TPProfile], cluster: Cluster, lay: Layout, global_batch: int,
             training: bool = True, memo: dict | None = None) -> Estimate:
    """The predicted step of one layout (an Estimate whose `fits` says whether it fits in memory).

    `memo`, a dict kept across the estimates of one profile and cluster, shares the per-block
    quantities and their block graph (`Estimate.graph`) between layouts that differ only in what
    those do not read: DDP or FSDP, and dp, pp and microbatches at the same microbatch size, GPU
    count and whether pp is 1.
    """
    b = global_batch // (lay.dp * lay.microbatches)
    key = (id(tpp), lay.tp, lay.sequence_parallel, lay.recompute, lay.replicate, lay.pp > 1,
           lay.tp * lay.dp * lay.pp, b, training)
    if memo is not None and key in memo:
        blocks, graph = memo[key]
    else:
        blocks = _blocks(profile, tpp, cluster, lay, b, training)
        graph = block_graph([blk.name for blk in profile.blocks], blocks.time,
                            [p * STATE_BYTES for p in blocks.params], blocks.act, blocks.send_bytes, blocks.send_s)
        if memo is not None:
            memo[key] = blocks, graph
    parts, mem = _stage_memory(blocks, cluster, lay, training)
    names = [blk.name for blk in profile.blocks]
    cut = partition(graph, lay.pp, mem, cluster.usable_memory)
    fits = cut is not None
    if cut is None:  # nothing fits: report the time-balanced cut and how much it needs
        cut = partition(graph, lay.pp)
    if cut is None:
        raise ValueError(f"cannot cut {len(names)} blocks into {lay.pp} stages")
    return _assemble(lay, b, cut, blocks, parts, cluster, training, fits, graph)


def _assemble(lay: Layout, b: int, cut: Partition, blocks: _Blocks, parts, cluster: Cluster, training: bool,
              fits: bool, graph: nx.DiGraph) -> Estimate:
    """Step time, memory and communication from the stage cut."""
    m, p = lay.microbatches, lay.pp
    over = cluster.microbatch_overhead  # every stage pays it once per microbatch, like its blocks' time
    slowest = cut.slowest + over
    stage = [(sum(blocks.compute[i:j]), sum(blocks.tp_s[i:j]), sum(blocks.tp_bytes[i:j]),
              blocks.send_s[j - 1], blocks.send_bytes[j - 1] * (2 if training else 1), sum(blocks.params[i:j]),
              sum(blocks.tensors[i:j])) for i, j in cut.bounds]
    mean = lambda k: sum(s[k] for s in stage) / p  # noqa: E731
    dp_s, dp_bytes, opt_s = 0.0, 0.0, 0.0
    if training:
        for (i, j), st in zip(cut.bounds, stage):
            d_s, d_bytes = _data_parallel(st[5], j - i, st[0] * m, st[0], cluster, lay, training)
            dp_s, dp_bytes = max(dp_s, d_s), max(dp_bytes, d_bytes)
            local = st[5] / (lay.dp if lay.data_parallel == "fsdp" else 1)
            opt_s = max(opt_s, local * cluster.optimizer_bytes / cluster.memory_bw
                        + st[6] * cluster.optimizer_ops * cluster.op_overhead)
    time = {"compute": m * mean(0), "tp_comm": m * mean(1), "pp_comm": m * mean(3),
            "overhead": m * over + (cluster.step_overhead if training else 0.0),
            "imbalance": m * (slowest - over - sum(cut.times) / p), "bubble": (p - 1) * slowest,
            "dp_comm": dp_s, "optimizer": opt_s}
    _lend_waits(time, cluster)
    fullest = max(range(p), key=lambda s: cut.memory[s]) if fits else \
        max(range(p), key=lambda s: sum(parts(*cut.bounds[s], s).values()))
    mparts = parts(*cut.bounds[fullest], fullest)
    comm_bytes = {"tp": m * max(s[2] for s in stage), "dp": dp_bytes,
                  "pp": m * max(s[4] for s in stage) if p > 1 else 0.0}
    return Estimate(lay, b, sum(time.values()), sum(mparts.values()), fits, time, comm_bytes, mparts,
                    cut.bounds, graph)


def _lend_waits(time: dict[str, float], cluster: Cluster) -> None:
    """Ranks that share cores lend theirs while they wait: shorten the bubble and imbalance to what that leaves.

    With r ranks on c < r cores every rate is already divided by r / c (each rank's share when all
    are busy). A rank idle in the pipeline bubble or waiting on a slower stage gives its core to the
    others, so the step takes the larger of the busy time (the cores' total work) and the critical
    path at a whole core's speed, (busy + waits) * c / r.
    """
    if not cluster.shared_cores or cluster.gpus <= cluster.shared_cores:
        return
    waits = time["bubble"] + time["imbalance"]
    if waits <= 0:
        return
    busy = sum(time.values()) - waits
    kept = max(0.0, (busy + waits) * cluster.shared_cores / cluster.gpus - busy) / waits
    time["bubble"] *= kept
    time["imbalance"] *= kept


def _data_parallel(params: float, units: int, step_compute: float, micro_compute: float, cluster: Cluster,
                   lay: Layout, training: bool) -> tuple[float, float]:
    """Exposed seconds and bytes sent per GPU of one stage's gradient sync over the dp group."""
    d = lay.dp
    calls = (2 * lay.microbatches if lay.pp == 1 else 1) + 1  # FSDP gathers per microbatch (or once), reduces once
    # FSDP's own work around each call (the runtime wraps with FSDP even at dp = 1)
    fsdp_work = units * calls * cluster.fsdp_overhead if lay.data_parallel == "fsdp" and training else 0.0
    if d <= 1:
        return fsdp_work, 0.0
    bw, alpha = cluster.link(lay.tp * d)
    grads = params * GRAD_BYTES
    if lay.data_parallel == "fsdp":
        weights = params * cluster.dtype_bytes
        gather = comm.all_gather(weights, d, bw, alpha)
        # without pipelining each microbatch gathers a block in forward and again in backward; with it the
        # gathered blocks stay until the step ends; gradients are reduce-scattered once, after the last microbatch
        per_step = (gather.times(2 * lay.microbatches) if lay.pp == 1 else gather) + \
            comm.reduce_scatter(grads, d, bw, alpha)
        per_step = per_step + comm.Cost((units - 1) * calls * alpha * (d - 1), 0.0)  # one collective per block
        window = step_compute
    else:
        per_step = comm.all_reduce(grads, d, bw, alpha)
        window = micro_compute * 2 / 3  # the last microbatch's backward
    exposed = max(per_step.seconds * (1 - cluster.overlap), per_step.seconds - cluster.overlap * window, 0.0)
    return exposed + fsdp_work, per_step.sent
