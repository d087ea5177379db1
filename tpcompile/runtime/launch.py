"""Real torch.distributed runs on one machine: spawn the rank processes, run a function in each."""

from __future__ import annotations

import pickle
import queue as queue_mod
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tpcompile.errors import TPCompileError

__all__ = ["free_port", "launch"]

# Seconds a child may take to import torch and rendezvous, on top of the caller's timeout.
_STARTUP_S = 60.0
# Seconds to wait for a dead child's last message, which may still be in the pipe.
_GRACE_S = 5.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _portable(value: Any) -> Any:
    """value with every tensor detached and moved to CPU, so it pickles without autograd."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_portable(v) for v in value)
    if isinstance(value, dict):
        return {k: _portable(v) for k, v in value.items()}
    return value


def _worker(rank: int, world_size: int, port: int, backend: str, timeout: float,
            fn: Callable[..., Any], args: tuple, results: Any) -> None:
    """Run fn(rank, *args) in a fresh process group and send (rank, ok, payload) back."""
    try:
        torch.set_num_threads(1)
        if backend == "nccl":  # one GPU per rank, chosen before NCCL binds its communicator
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout))
        try:
            out = fn(rank, *args)
            # Keep peers alive until every rank has finished its last collective.
            dist.barrier()
        finally:
            dist.destroy_process_group()
        # Plain pickle copies tensor data, so the parent needs nothing from this process.
        results.put((rank, True, pickle.dumps(_portable(out))))
    except BaseException:  # noqa: BLE001  the parent must hear about every failure
        results.put((rank, False, traceback.format_exc()))


def _stop(procs: list) -> None:
    """Kill every child still running and reap them all."""
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        if p.pid is not None:
            p.join(timeout=10)


def launch(world_size: int, fn: Callable[..., Any], *args: Any, backend: str = "gloo",
           timeout: float = 120.0) -> list:
    """Run fn(rank, *args) in world_size spawned gloo/NCCL processes; results in rank order."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise TPCompileError(f"world_size must be an int >= 1, got {world_size!r}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, name=f"tpcompile-rank{r}",
                         args=(r, world_size, port, backend, timeout, fn, args, results))
             for r in range(world_size)]
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout + _STARTUP_S
    dead_since: dict[int, float] = {}
    try:
        for p in procs:
            try:
                p.start()
            except (pickle.PicklingError, AttributeError, TypeError) as e:
                raise TPCompileError(f"launch could not send fn or its arguments to the rank "
                                     f"processes ({e}); fn must be a module-level function "
                                     f"and its arguments picklable") from e
        while len(got) < world_size:
            now = time.monotonic()
            if now > deadline:
                late = [r for r in range(world_size) if r not in got]
                raise TPCompileError(f"ranks {late} did not finish within "
                                     f"{timeout + _STARTUP_S:g} s; killed them")
            try:
                rank, ok, payload = results.get(timeout=min(0.5, deadline - now))
            except queue_mod.Empty:
                _check_dead(procs, got, dead_since)
                continue
            if not ok:
                raise TPCompileError(f"rank {rank} failed:\n{payload}")
            got[rank] = pickle.loads(payload)
        for p in procs:
            p.join(timeout=10)
    finally:
        _stop(procs)
    return [got[r] for r in range(world_size)]


def _check_dead(procs: list, got: dict[int, Any], dead_since: dict[int, float]) -> None:
    """Raise when a child exited without reporting, after a grace period for its message."""
    for r, p in enumerate(procs):
        if r in got or p.exitcode is None:
            continue
        first = dead_since.setdefault(r, time.monotonic())
        if time.monotonic() - first > _GRACE_S:
            raise TPCompileError(f"rank {r} exited with code {p.exitcode} without a result "
                                 f"(killed, or fn could not be unpickled in the child)")
