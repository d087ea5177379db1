"""This machine as a cluster: one CPU process per rank, rates measured once and cached.

A short measurement (about half a minute, run the first time it is asked for and then read from
`$TPCOMPILE_CACHE_DIR/calibration.json`, default ~/.cache/tpcompile): single-threaded matmul
FLOP/s (its ratio to the core's nominal peak, from /proc/cpuinfo, is the efficiency factor),
memory bandwidth of an elementwise op, the overhead of one op in forward and backward, gloo's
latency and bandwidth between two processes on 127.0.0.1, and the hybrid runtime's own overhead
per microbatch and per FSDP call (a small GPT trained in one process). With more ranks than
cores, the ranks share the cores and every rate is divided accordingly.
"""
from __future__ import annotations

import json
import os
import platform
import socket
import time
from pathlib import Path
from typing import Any, Callable

import torch

from tpcompile.strategy.cluster import Cluster

VERSION = 3


def cache_path() -> Path:
    """Where the measurement is kept."""
    root = os.environ.get("TPCOMPILE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tpcompile")
    return Path(root) / "calibration.json"


def _fingerprint() -> str:
    return f"v{VERSION}|{platform.node()}|{platform.processor() or platform.machine()}|{_cpu_name()}|" \
           f"torch {torch.__version__}|{_cores()} cores"


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def nominal_flops() -> float:
    """One core's fp32 peak from /proc/cpuinfo: clock x FMA lanes (0 when unknown)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return 0.0
    mhz = next((float(l.split(":")[1]) for l in text.splitlines() if l.startswith("cpu MHz")), 0.0)
    flags = next((l.split(":")[1].split() for l in text.splitlines() if l.startswith("flags")), [])
    per_cycle = 64 if "avx512f" in flags else 32 if "fma" in flags and "avx2" in flags else 8
    return mhz * 1e6 * per_cycle


def _best(fn: Callable[[], Any], repeats: int) -> float:
    """Fastest of `repeats` timed calls (the machine may be shared)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_compute() -> dict[str, float]:
    """Matmul FLOP/s, elementwise bytes/s and seconds per op (forward + backward over 3) on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(768, 768), torch.randn(768, 768)
        mm = 2 * 768 ** 3 / _best(lambda: torch.mm(a, b), 5)
        x, y = torch.randn(1 << 22), torch.randn(1 << 22)
        bw = 3 * 4 * (1 << 22) / _best(lambda: torch.add(x, y), 5)
        z = torch.randn(8, requires_grad=True)

        def chain() -> None:
            v = z
            for _ in range(200):
                v = v * 1.0001
            v.sum().backward()

        op = _best(chain, 5) / (200 * 3)
    finally:
        torch.set_num_threads(threads)
    return {"matmul_flops": mm, "memory_bw": bw, "op_overhead": op}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_rank(rank: int, port: int, out: Any) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        small, big = torch.zeros(1), torch.zeros(1 << 20)
        t_small = _best(lambda: dist.all_reduce(small), 30)
        t_big = _best(lambda: dist.all_reduce(big), 8)
        if rank == 0:
            out.put({"t_small": t_small, "t_big": t_big, "big_bytes": 4 * (1 << 20)})
    finally:
        dist.destroy_process_group()


def measure_gloo() -> dict[str, float]:
    """gloo all-reduce latency per ring step and bandwidth between two local processes."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_gloo_rank, args=(r, port, queue), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = queue.get(timeout=120)
    finally:
        for p in procs:
            p.join(timeout=30)
    # a 2-rank ring all-reduce is 2 steps and moves n bytes per rank
    alpha = got["t_small"] / 2
    bw = got["big_bytes"] / max(got["t_big"] - got["t_small"], 1e-9)
    return {"alpha": alpha, "bandwidth": bw}


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

            times[f"{kind}{m}"] = _best(step, 5)
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
    proc = ctx.Process(target=_runtime_rank, args=(_free_port(), queue), daemon=True)
    proc.start()
    try:
        got = queue.get(timeout=600)
    finally:
        proc.join(timeout=30)
    base = _cluster(partial, 1, {"microbatch_overhead": 0.0, "fsdp_overhead": 0.0})
    with torch.device("meta"):
        model = GPT(GPTConfig(**RUNTIME_GPT))
    profile = build_profile(model, example_inputs=(torch.ones(RUNTIME_BATCH, dtype=torch.long, device="meta"),),
                            seq_len=RUNTIME_BATCH[1])
    from tpcompile.strategy.tp_profile import tp_profile
    tpp = tp_profile(profile, 1)  # the runtime's graphs at tp = 1 still call their collectives
    pred = {f"{kind}{m}": estimate(profile, tpp, base, Layout(1, 1, 1, m, data_parallel=kind),
                                   RUNTIME_BATCH[0]).step_s for m, kind in RUNTIME_RUNS}
    per_mb = max(0.0, ((got["ddp4"] - got["ddp1"]) - (pred["ddp4"] - pred["ddp1"])) / 3)
    units = len(profile.blocks) * 3  # one FSDP unit per block: gather in forward, in backward, reduce once
    per_fsdp = max(0.0, ((got["fsdp1"] - got["ddp1"]) - (pred["fsdp1"] - pred["ddp1"])) / units)
    return {"microbatch_overhead": per_mb, "fsdp_overhead": per_fsdp, **{f"runtime_{k}": v for k, v in got.items()}}


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
    data: dict[str, Any] = {**measure_compute(), **measure_gloo(), "nominal_flops": nominal_flops(),
                            "cores": _cores(), "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
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
    fields = {"microbatch_overhead": cal.get("microbatch_overhead", 0.0), "fsdp_overhead": cal.get("fsdp_overhead", 0.0),
              **overrides}
    return Cluster(gpus=ranks, gpus_per_node=ranks, gpu_memory=total / ranks, intra_bw=cal["bandwidth"] / share,
                   inter_bw=cal["bandwidth"] / share, flops=nominal / share,
                   efficiency=min(1.0, cal["matmul_flops"] / nominal), memory_bw=cal["memory_bw"] / share,
                   intra_latency=cal["alpha"] * share, inter_latency=cal["alpha"] * share,
                   op_overhead=cal["op_overhead"] * share, microbatch_overhead=fields["microbatch_overhead"] * share,
                   fsdp_overhead=fields["fsdp_overhead"] * share, overlap=0.0, dtype="fp32", memory_margin=0.2,
                   name="this machine (CPU, gloo)")


def _memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8e9
