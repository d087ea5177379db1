"""This machine as a cluster: one CPU process per rank, rates measured once and cached.

A short measurement (a few seconds, run the first time it is asked for and then read from
`$TPCOMPILE_CACHE_DIR/calibration.json`, default ~/.cache/tpcompile): single-threaded matmul
FLOP/s (its ratio to the core's nominal peak, from /proc/cpuinfo, is the efficiency factor),
memory bandwidth of an elementwise op, the overhead of one op in forward and backward, and
gloo's latency and bandwidth between two processes on 127.0.0.1. With more ranks than cores,
the ranks share the cores and every rate is divided accordingly.
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

VERSION = 1


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
    data = {**measure_compute(), **measure_gloo(), "nominal_flops": nominal_flops(), "cores": _cores(),
            "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    cached[key] = data
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cached, indent=1))
    return data


def this_machine(ranks: int, *, refresh: bool = False, memory: float | None = None) -> Cluster:
    """This machine as a cluster of `ranks` single-threaded CPU processes talking gloo."""
    cal = calibration(refresh)
    share = max(1.0, ranks / cal["cores"])  # ranks beyond the cores take turns
    nominal = cal["nominal_flops"] or cal["matmul_flops"]
    total = memory if memory is not None else _memory_bytes()
    return Cluster(gpus=ranks, gpus_per_node=ranks, gpu_memory=total / ranks, intra_bw=cal["bandwidth"] / share,
                   inter_bw=cal["bandwidth"] / share, flops=nominal / share,
                   efficiency=min(1.0, cal["matmul_flops"] / nominal), memory_bw=cal["memory_bw"] / share,
                   intra_latency=cal["alpha"] * share, inter_latency=cal["alpha"] * share,
                   op_overhead=cal["op_overhead"] * share, overlap=0.0, dtype="fp32", memory_margin=0.2,
                   name="this machine (CPU, gloo)")


def _memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8e9
