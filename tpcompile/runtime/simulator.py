"""Threads as ranks: run per-rank code at once and exchange collective tensors in memory.

Every rank reduces the gathered tensors in rank order, so all ranks get bitwise-identical
results. Backward must run on the rank's own thread, which CPU autograd does (the engine
runs CPU work on the thread that calls ``backward``); CUDA tensors are not supported here.
Every group key names the whole simulated world.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from tpcompile.errors import TPCompileError
from tpcompile.ops.schedule import CollectiveCall
from tpcompile.runtime.backends import register_resolver
from tpcompile.runtime.shape_cache import rank_graphs_for

__all__ = ["SimulatedRank", "current_rank", "simulate", "simulate_ranks"]

_local = threading.local()


class _RankAborted(TPCompileError):
    """A collective gave up because another rank failed first."""


@dataclass
class _Call:
    """One collective call as every rank sees it: the k-th collective of each rank."""

    slots: list[tuple[CollectiveCall, torch.Tensor] | None]
    arrived: int = 0
    read: int = 0


@dataclass
class _World:
    """The shared state of one simulate_ranks run: rendezvous per collective call."""

    world_size: int
    timeout: float
    cond: threading.Condition = field(default_factory=threading.Condition)
    calls: dict[int, _Call] = field(default_factory=dict)
    seq: list[int] = field(default_factory=list)
    finished: set[int] = field(default_factory=set)
    failure: tuple[int, str] | None = None

    def __post_init__(self) -> None:
        """Start every rank at collective number zero."""
        self.seq = [0] * self.world_size

    def exchange(self, rank: int, call: CollectiveCall, x: torch.Tensor) -> list[torch.Tensor]:
        """Deposit x for this rank's next collective and return every rank's x in rank order."""
        deadline = time.monotonic() + self.timeout
        op = call.op
        with self.cond:
            k = self.seq[rank]
            self.seq[rank] += 1
            slot = self.calls.setdefault(k, _Call([None] * self.world_size))
            if self.failure is not None:
                self._raise_if_doomed(rank, op, k, slot)
            slot.slots[rank] = (call, x)
            slot.arrived += 1
            self.cond.notify_all()
            while slot.arrived < self.world_size:
                self._raise_if_doomed(rank, op, k, slot)
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [r for r, s in enumerate(slot.slots) if s is None]
                    msg = (f"tpcompile.{op} on rank {rank} (collective #{k}) waited more than "
                           f"{self.timeout:g} s for ranks {missing}; they are stuck or slower than that: "
                           f"pass a larger timeout= to simulate_ranks, or make every rank issue the same collectives")
                    self.failure = (rank, msg)
                    self.cond.notify_all()
                    raise TPCompileError(msg)
                self.cond.wait(left)
            entries = list(slot.slots)
            slot.read += 1
            if slot.read == self.world_size:
                del self.calls[k]
        _check_same(entries, rank, k)
        return [e[1] for e in entries]  # type: ignore[index]

    def _raise_if_doomed(self, rank: int, op: str, k: int, call: _Call) -> None:
        """Raise when call k can never complete: a rank failed or returned without joining."""
        if self.failure is not None:
            bad, why = self.failure
            raise _RankAborted(f"tpcompile.{op} on rank {rank} aborted because rank {bad} "
                               f"failed: {why}")
        gone = sorted(r for r in self.finished if call.slots[r] is None)
        if gone:
            raise TPCompileError(
                f"tpcompile.{op} on rank {rank} (collective #{k}) can never complete: ranks "
                f"{gone} returned without calling it; every rank must issue the same "
                f"collectives in the same order")

    def end_rank(self, rank: int, error: str | None) -> None:
        """Mark rank as done (error is None) or failed, waking ranks waiting on it."""
        with self.cond:
            self.finished.add(rank)
            if error is not None and self.failure is None:
                self.failure = (rank, error)
            self.cond.notify_all()


def _check_same(entries: list, rank: int, k: int) -> None:
    """Raise when the ranks called different collectives (op, dim, shape, dtype) at step k."""
    first = entries[0][0]
    if any(e[0] != first for e in entries):
        seen = "; ".join(f"rank {r}: {e[0]}" for r, e in enumerate(entries))
        raise TPCompileError(f"collective #{k} differs across ranks (seen on rank {rank}): {seen}; every rank must "
                             f"run the same graph on inputs of the same shapes")


class SimulatedRank:
    """The collective backend of one simulated rank: tensors travel through shared memory."""

    def __init__(self, world: _World, rank: int) -> None:
        """Bind this rank to the shared world."""
        self._world = world
        self.rank = rank
        self.world_size = world.world_size

    def _gather(self, op: str, x: torch.Tensor, dim: int | None) -> list[torch.Tensor]:
        """Exchange x with every rank, checking that all ranks agree on the call."""
        call = CollectiveCall(op, tuple(str(int(d)) for d in x.shape), str(x.dtype), () if dim is None else (dim,))
        return self._world.exchange(self.rank, call, x)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over ranks, adding in rank order."""
        xs = self._gather("all_reduce", x, None)
        out = xs[0].clone(memory_format=torch.contiguous_format)
        for t in xs[1:]:
            out.add_(t)
        return out

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every rank's x along dim in rank order."""
        return torch.cat(self._gather("all_gather", x, dim), dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Sum x over ranks in rank order and keep this rank's chunk along dim."""
        xs = self._gather("reduce_scatter", x, dim)
        n = x.shape[dim] // self.world_size
        out = xs[0].narrow(dim, self.rank * n, n).clone(memory_format=torch.contiguous_format)
        for t in xs[1:]:
            out.add_(t.narrow(dim, self.rank * n, n))
        return out


def current_rank() -> SimulatedRank | None:
    """The simulated rank of the calling thread, or None outside simulate_ranks."""
    return getattr(_local, "rank", None)


register_resolver(lambda group: current_rank())  # collectives on a simulated rank's thread run here


def simulate_ranks(world_size: int, fn: Callable[[int], Any], *,
                   timeout: float = 120.0) -> list:
    """Run fn(rank) on world_size threads at once and return the results in rank order."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise TPCompileError(f"world_size must be an int >= 1, got {world_size!r} ({type(world_size).__name__}); "
                             f"pass the number of simulated ranks, e.g. simulate_ranks(2, fn)")
    import tpcompile.ops  # noqa: F401  registers torch.ops.tpcompile* for fn's graphs

    world = _World(world_size, float(timeout))
    results: list[Any] = [None] * world_size
    errors: dict[int, BaseException] = {}
    grad_enabled = torch.is_grad_enabled()  # grad mode and autocast are per thread: carry the caller's over
    autocast = [(d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]

    def run(rank: int) -> None:
        """Run fn as this thread's rank and report how it ended."""
        _local.rank = SimulatedRank(world, rank)
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.set_grad_enabled(grad_enabled))
                for device, dtype in autocast:
                    stack.enter_context(torch.autocast(device, dtype=dtype))
                results[rank] = fn(rank)
            world.end_rank(rank, None)
        except BaseException as e:  # noqa: BLE001  any failure must release the other ranks
            errors[rank] = e
            world.end_rank(rank, f"{type(e).__name__}: {e}")
        finally:
            _local.rank = None

    threads = [threading.Thread(target=run, args=(r,), name=f"tpcompile-rank{r}", daemon=True)
               for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        # Short joins keep the caller interruptible while ranks run.
        while t.is_alive():
            t.join(0.5)
    if errors:
        causes = {r: e for r, e in errors.items() if not isinstance(e, _RankAborted)}
        rank, err = min((causes or errors).items())
        raise TPCompileError(f"simulated rank {rank} failed: {type(err).__name__}: {err}") from err
    return results


def simulate(sharded: Any, *args: Any, **kwargs: Any) -> list:
    """Run every rank's module of a ShardedModel on (args, kwargs) and return per-rank outputs.

    Inputs whose shape the rank graphs' guards refuse run on a capture for that shape (runtime/shape_cache.py).
    """
    ranks = rank_graphs_for(sharded, args, kwargs)  # built here, not on the rank threads; re-sharded for a new shape
    return simulate_ranks(sharded.world_size, lambda r: ranks[r](*args, **kwargs))
