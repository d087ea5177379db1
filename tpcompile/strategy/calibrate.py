"""This machine as a cluster: one CPU process per rank, rates measured once and cached.

A short measurement (about a minute, run the first time it is asked for and then read from
`$TPCOMPILE_CACHE_DIR/calibration.json`, default ~/.cache/tpcompile): single-threaded matmul
FLOP/s (its ratio to the core's nominal peak, from /proc/cpuinfo, is the efficiency factor),
memory bandwidth of an elementwise op, how much slower both run when every core runs one (cores
of a VM or of one socket share caches, memory and sometimes a physical core), the overhead of one
op in forward and backward, gloo's
bandwidth and latency on 127.0.0.1 at 2 and at 4 processes, and the hybrid runtime's own
overhead per step, per microbatch and per FSDP call (a small GPT trained in one process). The latency is
that of ranks that compute between their collectives, as a training step's ranks do: a rank
then waits until every peer has been scheduled, which costs milliseconds once the processes
outnumber the free cores, where idle ranks answer in a tenth of one. With more ranks than cores,
the ranks share the cores and every rate is divided accordingly; from 2 ranks on, the compute
rates are slowed by the measured contention (in full once every core runs a rank); gloo's numbers at a number of
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
                                              measure_gloo, nominal_flops)

VERSION = 6
GLOO_RANKS = (2, 4)  # the process counts gloo is measured at
# torch.optim.AdamW as the runtime's users build it runs its single-tensor loop on CPU (no foreach or
# fused kernel there). Per parameter tensor and step it runs 10 ops (step += 1, the decay mul_, lerp_,
# mul_ and addcmul_ of the moments, the step's item(), sqrt, div, add_ of eps, addcdiv_), and per
# element they read and write 80 bytes of fp32 (8 + 12 + 8 + 12 + 8 + 8 + 8 + 16), against one
# fused kernel moving 32 on a GPU.
ADAMW_OPS = 10.0
ADAMW_BYTES = 80.0


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


def _runtime_rank(port: int, out: Any) -> None:
    """One process: the hybrid runtime's step time for a small GPT at (1 microbatch, DDP), (4, DDP), (1, FSDP)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    import tpcompile
    from tpcompile.models import GPT, GPTConfig
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        mesh = tpcompile.init_mesh()
        ids = torch.randint(0, 256, RUNTIME_BATCH, generator=torch.Generator().manual_seed(0))

        def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(logits.flatten(0, 1), target.flatten())

        times = {}
        for m, kind in RUNTIME_RUNS:
            torch.manual_seed(0)
            hm = tpcompile.parallelize_train(GPT(GPTConfig(**RUNTIME_GPT)).train(), mesh, loss_fn=loss,
                                             example_inputs=(ids,), microbatches=m, data_parallel=kind)
            opt = torch.optim.AdamW(hm.parameters())

            def step() -> None:
                opt.zero_grad()
                hm.step(ids, target=ids)
                opt.step()

            times[f"{kind}{m}"] = best_of(step, 5)
        out.put(times)
    finally:
        dist.destroy_process_group()


RUNTIME_GPT = {"n_layer": 2, "n_embd": 64, "n_head": 4, "block_size": 32, "vocab_size": 256}
RUNTIME_BATCH = (8, 32)
RUNTIME_RUNS = ((1, "ddp"), (4, "ddp"), (1, "fsdp"))


def measure_runtime(partial: dict[str, float]) -> dict[str, float]:
    """Overheads of the hybrid runtime the op count does not explain: per microbatch and stage, per FSDP call.

    A small GPT trains in one process at 1 and 4 microbatches (DDP) and 1 (FSDP); what the cost model
    (with the rates measured so far) does not predict of the differences is the overhead.
    """
    import torch.multiprocessing as mp
    from tpcompile.models import GPT, GPTConfig
    from tpcompile.strategy.cost import Layout, estimate
    from tpcompile.strategy.profile import build_profile
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_runtime_rank, args=(free_port(), queue), daemon=True)
    proc.start()
    try:
        got = queue.get(timeout=600)
    finally:
        proc.join(timeout=30)
    base = _cluster(partial, 1, {"microbatch_overhead": 0.0, "fsdp_overhead": 0.0, "step_overhead": 0.0})
    with torch.device("meta"):
        model = GPT(GPTConfig(**RUNTIME_GPT))
    profile = build_profile(model, example_inputs=(torch.ones(RUNTIME_BATCH, dtype=torch.long, device="meta"),),
                            seq_len=RUNTIME_BATCH[1])
    from tpcompile.strategy.tp_profile import tp_profile
    tpp = tp_profile(profile, 1)  # the runtime runs the degree-1 graphs, as at every tp
    pred = {f"{kind}{m}": estimate(profile, tpp, base, Layout(1, 1, 1, m, data_parallel=kind),
                                   RUNTIME_BATCH[0]).step_s for m, kind in RUNTIME_RUNS}
    per_mb = max(0.0, ((got["ddp4"] - got["ddp1"]) - (pred["ddp4"] - pred["ddp1"])) / 3)
    units = len(profile.blocks) * 3  # one FSDP unit per block: gather in forward, in backward, reduce once
    per_fsdp = max(0.0, ((got["fsdp1"] - got["ddp1"]) - (pred["fsdp1"] - pred["ddp1"])) / units)
    per_step = max(0.0, got["ddp1"] - pred["ddp1"] - per_mb)  # what one microbatch's step still leaves out
    return {"microbatch_overhead": per_mb, "fsdp_overhead": per_fsdp, "step_overhead": per_step,
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
    fields = {k: cal.get(k, 0.0) for k in ("microbatch_overhead", "fsdp_overhead", "step_overhead")}
    fields.update(overrides)
    alpha, bw, more = _gloo_at(cal, ranks)
    mm_slow, mem_slow = (_contended(cal.get(k, 1.0), ranks, cal["cores"])
                         for k in ("matmul_contention", "memory_contention"))
    return Cluster(gpus=ranks, gpus_per_node=ranks, gpu_memory=total / ranks, intra_bw=bw / more,
                   inter_bw=bw / more, flops=nominal / share,
                   efficiency=min(1.0, cal["matmul_flops"] / nominal / mm_slow),
                   memory_bw=cal["memory_bw"] / share / mem_slow,
                   intra_latency=alpha * more, inter_latency=alpha * more,
                   op_overhead=cal["op_overhead"] * share, microbatch_overhead=fields["microbatch_overhead"] * share,
                   fsdp_overhead=fields["fsdp_overhead"] * share, step_overhead=fields["step_overhead"] * share,
                   shared_cores=cal["cores"], optimizer_bytes=ADAMW_BYTES, optimizer_ops=ADAMW_OPS,
                   overlap=0.0, dtype="fp32", memory_margin=0.2,
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
