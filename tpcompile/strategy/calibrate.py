"""This machine as a cluster: one CPU process per rank, rates measured once and cached.

A short measurement (about a minute, run the first time it is asked for and then read from
`$TPCOMPILE_CACHE_DIR/calibration.json`, default ~/.cache/tpcompile): single-threaded matmul
FLOP/s (its ratio to the core's nominal peak, from /proc/cpuinfo, is the efficiency factor),
memory bandwidth of an elementwise op, how much slower both run when every core runs one (cores
of a VM or of one socket share caches, memory and sometimes a physical core), the overhead of one
op in forward and backward, the cost of an AdamW step per parameter tensor and per parameter, gloo's
bandwidth and latency on 127.0.0.1 at 2 and at 4 processes, and the hybrid runtime's own
overhead per step, per microbatch and per FSDP call (a small GPT trained in one process) and per
pipelined microbatch and stage (the same GPT over 2 processes). The latency is
that of ranks that compute between their collectives, as a training step's ranks do: a rank
then waits until every peer has been scheduled, which costs milliseconds once the processes
outnumber the free cores, where idle ranks answer in a tenth of one. With more ranks than cores,
the ranks share the cores and every rate is divided accordingly; from 2 ranks on, the compute
rates are slowed by the measured contention (in full once every core runs a rank), and a rank that waits in a
pipeline bubble lends its core to the others (Cluster.shared_cores); gloo's numbers at a number of
ranks are those measured at the most ranks not above it (divided likewise beyond them).
"""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from tpcompile.strategy.cluster import Cluster
from tpcompile.strategy.machine_rates import (best_of, free_port, cores, measure_compute, measure_contention,
                                              measure_gloo, measure_optimizer, nominal_flops)

VERSION = 6
GLOO_RANKS = (2, 4)  # the process counts gloo is measured at


def cache_path() -> Path:
    """Where the measurement is kept."""
    root = os.environ.get("TPCOMPILE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tpcompile")
    return Path(root) / "calibration.json"


def _fingerprint() -> str:
    return f"v{VERSION}|{platform.node()}|{platform.processor() or platform.machine()}|{_cpu_name()}|" \
           f"torch {torch.__version__}|{cores()} cores"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _runtime_rank(rank: int, world: int, port: int, out: Any) -> None:
    """One process of `world`: the hybrid runtime's step time for a small GPT at each of RUNTIME_RUNS[world] (the
    mesh over the processes, microbatches, DDP or FSDP); rank 0 reports."""
    import torch.distributed as dist
    import torch.nn.functional as F
    import tpcompile
    from tpcompile.models import GPT, GPTConfig
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        ids = torch.randint(0, 256, RUNTIME_BATCH, generator=torch.Generator().manual_seed(0))

        def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(logits.flatten(0, 1), target.flatten())

        times = {}
        for name, dims, m, kind in RUNTIME_RUNS[world]:
            torch.manual_seed(0)
            mesh = tpcompile.init_mesh(**dims)
            hm = tpcompile.parallelize_train(GPT(GPTConfig(**RUNTIME_GPT)).train(), mesh, loss_fn=loss,
                                             example_inputs=(ids,), microbatches=m, data_parallel=kind)
            opt = torch.optim.AdamW(hm.parameters())

            def step() -> None:
                opt.zero_grad()
                hm.step(ids, target=ids)
                opt.step()
                if world > 1:
                    dist.barrier()

            times[name] = best_of(step, 5)
        if rank == 0:
            out.put(times)
    finally:
        dist.destroy_process_group()


RUNTIME_GPT = {"n_layer": 2, "n_embd": 64, "n_head": 4, "block_size": 32, "vocab_size": 256}
RUNTIME_BATCH = (8, 32)
RUNTIME_RUNS = {  # processes: (name, mesh, microbatches, data parallel) of each run
    1: (("ddp1", {}, 1, "ddp"), ("ddp4", {}, 4, "ddp"), ("fsdp1", {}, 1, "fsdp")),
    2: (("pp2", {"pp": 2}, 2, "ddp"), ("pp4", {"pp": 2}, 4, "ddp"), ("tp1", {"tp": 2}, 1, "ddp"))}


def _run_runtime(world: int) -> dict[str, float]:
    """Step times of RUNTIME_RUNS[world], in `world` spawned processes."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_runtime_rank, args=(r, world, port, queue), daemon=True) for r in range(world)]
    for proc in procs:
        proc.start()
    try:
        return queue.get(timeout=600)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()


def measure_runtime(partial: dict[str, float]) -> dict[str, float]:
    """Overheads of the hybrid runtime the op count does not explain: per microbatch and stage, per FSDP call.

    A small GPT trains in one process at 1 and 4 microbatches (DDP) and 1 (FSDP), pipelined over 2
    processes at 2 and 4 microbatches, and split over 2 (tp = 2); what the cost model (with the rates
    measured so far) does not predict of the differences is the overhead; what it does not predict of
    the tensor-parallel step, per collective, is the collective overhead (ranks waiting on each other).
    """
    from tpcompile.models import GPT, GPTConfig
    from tpcompile.strategy.cost import Layout, estimate
    from tpcompile.strategy.profile import build_profile
    got = {**_run_runtime(1), **_run_runtime(2)}
    zero = {"microbatch_overhead": 0.0, "fsdp_overhead": 0.0, "step_overhead": 0.0, "pipeline_overhead": 0.0,
            "collective_overhead": 0.0}
    base = _cluster(partial, 1, zero)
    with torch.device("meta"):
        model = GPT(GPTConfig(**RUNTIME_GPT))
    profile = build_profile(model, example_inputs=(torch.ones(RUNTIME_BATCH, dtype=torch.long, device="meta"),),
                            seq_len=RUNTIME_BATCH[1])
    from tpcompile.strategy.tp_profile import tp_profile
    tpp = tp_profile(profile, 1)  # the runtime runs the degree-1 graphs, as at every tp
    pred = {name: estimate(profile, tpp, base, Layout(1, 1, 1, m, data_parallel=kind), RUNTIME_BATCH[0]).step_s
            for name, _, m, kind in RUNTIME_RUNS[1]}
    per_mb = max(0.0, ((got["ddp4"] - got["ddp1"]) - (pred["ddp4"] - pred["ddp1"])) / 3)
    units = len(profile.blocks) * 3  # one FSDP unit per block: gather in forward, in backward, reduce once
    per_fsdp = max(0.0, ((got["fsdp1"] - got["ddp1"]) - (pred["fsdp1"] - pred["ddp1"])) / units)
    per_step = max(0.0, got["ddp1"] - pred["ddp1"] - per_mb)  # what one microbatch's step still leaves out
    # pipelined: each further microbatch costs one more stage slot; the step's own overhead cancels in the difference
    two = {x: _cluster(partial, 2, {**zero, "pipeline_overhead": x}) for x in (0.0, 1e-3)}
    pp = {x: {m: estimate(profile, tpp, c, Layout(1, 1, 2, m), RUNTIME_BATCH[0]).step_s for m in (2, 4)}
          for x, c in two.items()}
    slope = ((pp[1e-3][4] - pp[0.0][4]) - (pp[1e-3][2] - pp[0.0][2])) / 1e-3  # seconds of step per second of X
    per_stage = max(0.0, ((got["pp4"] - got["pp2"]) - (pp[0.0][4] - pp[0.0][2])) / slope)
    # split over 2: every other overhead as calibrated, the rest per collective
    known = {"microbatch_overhead": per_mb, "fsdp_overhead": per_fsdp, "step_overhead": per_step}
    tp2 = tp_profile(profile, 2)
    split = {x: estimate(profile, tp2, _cluster(partial, 2, {**zero, **known, "collective_overhead": x}),
                         Layout(2, 1, 1, 1), RUNTIME_BATCH[0]).step_s for x in (0.0, 1e-3)}
    per_coll = max(0.0, (got["tp1"] - split[0.0]) / ((split[1e-3] - split[0.0]) / 1e-3))
    return {"microbatch_overhead": per_mb, "pipeline_overhead": per_stage, "fsdp_overhead": per_fsdp,
            "step_overhead": per_step, "collective_overhead": per_coll,
            **{f"runtime_{k}": v for k, v in got.items()}}


def calibration(refresh: bool = False) -> dict[str, float]:
    """The measured rates of this machine, from the cache unless `refresh` or missing."""
    path = cache_path()
    key = _fingerprint()
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if not refresh and isinstance(cached.get(key), dict):
        return cached[key]
    data: dict[str, Any] = {**measure_compute(), **measure_contention(cores()), **measure_gloo(),
                            "nominal_flops": nominal_flops(),
                            "cores": cores(), "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    data.update(measure_optimizer(data["memory_bw"], data["op_overhead"]))
    for world in GLOO_RANKS:
        got = measure_gloo(world) if world != 2 else data
        data[f"alpha_{world}"], data[f"bandwidth_{world}"] = got["alpha"], got["bandwidth"]
    data.update(measure_runtime(data))
    cached[key] = data
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cached, indent=1))
    return data


def this_machine(ranks: int, *, refresh: bool = False, memory: float | None = None) -> Cluster:
    """This machine as a cluster of `ranks` single-threaded CPU processes talking gloo."""
    return _cluster(calibration(refresh), ranks, {}, memory)


def _cluster(cal: dict[str, Any], ranks: int, overrides: dict[str, float], memory: float | None = None) -> Cluster:
    """The cluster the measured rates describe; ranks beyond the cores take turns on them."""
    share = max(1.0, ranks / cal["cores"])
    nominal = cal["nominal_flops"] or cal["matmul_flops"]
    total = memory if memory is not None else _memory_bytes()
    fields = {k: cal.get(k, 0.0) for k in ("microbatch_overhead", "fsdp_overhead", "step_overhead",
                                           "collective_overhead")}
    fields["pipeline_overhead"] = cal.get("pipeline_overhead")  # None (as microbatch_overhead) if not measured
    fields.update(overrides)
    pipelined = fields["pipeline_overhead"]
    alpha, bw, more = _gloo_at(cal, ranks)
    mm_slow, mem_slow = (_contended(cal.get(k, 1.0), ranks, cal["cores"])
                         for k in ("matmul_contention", "memory_contention"))
    return Cluster(gpus=ranks, gpus_per_node=ranks, gpu_memory=total / ranks, intra_bw=bw / more,
                   inter_bw=bw / more, flops=nominal / share,
                   efficiency=min(1.0, cal["matmul_flops"] / nominal / mm_slow),
                   memory_bw=cal["memory_bw"] / share / mem_slow,
                   intra_latency=alpha * more, inter_latency=alpha * more,
                   op_overhead=cal["op_overhead"] * share, microbatch_overhead=fields["microbatch_overhead"] * share,
                   pipeline_overhead=None if pipelined is None else pipelined * share,
                   fsdp_overhead=fields["fsdp_overhead"] * share, step_overhead=fields["step_overhead"] * share,
                   collective_overhead=fields["collective_overhead"] * share,
                   optimizer_bytes=cal.get("optimizer_bytes", 32.0), optimizer_ops=cal.get("optimizer_ops", 1.0),
                   shared_cores=cal["cores"], overlap=0.0, dtype="fp32", memory_margin=0.2,
                   name="this machine (CPU, gloo)")


def _contended(factor: float, ranks: int, cores: int) -> float:
    """The slow-down of a rate with `ranks` busy processes: 1 alone, `factor` once every core runs one (linear
    between)."""
    if cores <= 1:
        return 1.0
    return 1.0 + (factor - 1.0) * (min(ranks, cores) - 1) / (cores - 1)


def _gloo_at(cal: dict[str, Any], ranks: int) -> tuple[float, float, float]:
    """gloo's (latency, bandwidth) measured at the most ranks not above `ranks`, and how many times more the cores
    are shared at `ranks` than there (the factor still to apply)."""
    measured = [w for w in GLOO_RANKS if f"alpha_{w}" in cal and w <= ranks]
    if not measured:  # a calibration that measured 2 processes only
        return cal["alpha"], cal["bandwidth"], max(1.0, ranks / cal["cores"])
    w = max(measured)
    more = max(1.0, ranks / cal["cores"]) / max(1.0, w / cal["cores"])
    return cal[f"alpha_{w}"], cal[f"bandwidth_{w}"], more


def _memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8e9
