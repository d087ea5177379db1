"""The rates of this machine, measured: one thread's matmul and memory rates, how much the cores slow each other
down, and gloo's latency and bandwidth between local processes (strategy/calibrate.py caches them).
"""
from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any, Callable

import torch


def cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


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


def best_of(fn: Callable[[], Any], repeats: int) -> float:
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
        mm = 2 * 768 ** 3 / best_of(lambda: torch.mm(a, b), 5)
        x, y = torch.randn(1 << 22), torch.randn(1 << 22)
        bw = 3 * 4 * (1 << 22) / best_of(lambda: torch.add(x, y), 5)
        z = torch.randn(8, requires_grad=True)

        def chain() -> None:
            v = z
            for _ in range(200):
                v = v * 1.0001
            v.sum().backward()

        op = best_of(chain, 5) / (200 * 3)
    finally:
        torch.set_num_threads(threads)
    return {"matmul_flops": mm, "memory_bw": bw, "op_overhead": op}


def _loop_seconds() -> tuple[float, float]:
    """Mean seconds of a mid-sized matmul and of a large elementwise add, over about half a second each."""
    torch.set_num_threads(1)
    a, b = torch.randn(512, 128), torch.randn(128, 384)
    x, y = torch.randn(1 << 20), torch.randn(1 << 20)

    def mean(fn: Callable[[], Any], n: int) -> float:
        fn()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - start) / n

    return mean(lambda: torch.mm(a, b), 600), mean(lambda: torch.add(x, y), 300)


def _contention_rank(start: Any, out: Any) -> None:
    start.wait()
    out.put(_loop_seconds())


def measure_contention(cores: int) -> dict[str, float]:
    """How much slower matmuls and memory-bound ops run when every core runs one (factors >= 1).

    The same loops run alone, then in `cores` processes at once; cores that share caches,
    memory bandwidth or a physical core (a VM's vCPUs) slow each other down.
    """
    if cores <= 1:
        return {"matmul_contention": 1.0, "memory_contention": 1.0}
    import torch.multiprocessing as mp
    alone = _loop_seconds()
    ctx = mp.get_context("spawn")
    queue, start = ctx.Queue(), ctx.Barrier(cores)  # they start together once every one has imported torch
    procs = [ctx.Process(target=_contention_rank, args=(start, queue), daemon=True) for _ in range(cores)]
    for p in procs:
        p.start()
    try:
        got = [queue.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
    mm, mem = (sorted(g[k] for g in got)[len(got) // 2] for k in (0, 1))
    return {"matmul_contention": max(1.0, mm / alone[0]), "memory_contention": max(1.0, mem / alone[1])}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _busy_collectives(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of fn() when the rank computes (a few ms of matmuls) before each call, as in a step."""
    a = torch.randn(256, 256)
    times = []
    for _ in range(repeats + 1):
        for _ in range(10):
            torch.mm(a, a)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[repeats // 2]


def _gloo_rank(rank: int, world: int, port: int, out: Any) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        small, big = torch.zeros(1), torch.zeros(1 << 20)
        t_small = best_of(lambda: dist.all_reduce(small), 30)
        t_big = best_of(lambda: dist.all_reduce(big), 8)
        t_busy = _busy_collectives(lambda: dist.all_reduce(small), 30)
        if rank == 0:
            out.put({"t_small": t_small, "t_big": t_big, "t_busy": t_busy, "big_bytes": 4 * (1 << 20)})
    finally:
        dist.destroy_process_group()


def measure_gloo(world: int = 2) -> dict[str, float]:
    """gloo all-reduce latency per ring step (between computing ranks) and bandwidth, `world` local processes."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_gloo_rank, args=(r, world, port, queue), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = queue.get(timeout=120)
    finally:
        for p in procs:
            p.join(timeout=30)
    # a ring all-reduce over p ranks is 2 (p - 1) steps and moves 2 (p - 1) / p x n bytes per rank
    steps = 2 * (world - 1)
    bw = got["big_bytes"] * steps / world / max(got["t_big"] - got["t_small"], 1e-9)
    return {"alpha": got["t_busy"] / steps, "bandwidth": bw, "alpha_idle": got["t_small"] / steps}
