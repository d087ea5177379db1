"""Where a collective runs: the group registry and the backends that carry out exchanges.

A collective op (tpcompile.ops.collectives) asks `current_backend(group)` for the backend of
the calling thread. Runtimes register a resolver here instead of being imported by the ops:
the simulator answers for threads that are simulated ranks, and torch.distributed answers
for a process in an initialised process group. So the ops know no runtime, and no runtime
needs the ops at import time.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

import torch
import torch.distributed as dist

from tpcompile.errors import TPCompileError
from tpcompile.runtime.failures import collective_error

__all__ = ["Backend", "DistBackend", "current_backend", "forget_process_groups", "rank_of", "register_group",
           "register_resolver", "unregister_group", "world_size_of"]

# torch >= 2.13 renames the tensor-in/tensor-out collectives; older releases keep the old names.
_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Backend(Protocol):
    """What a collective needs from a runtime: the rank's place and three exchanges."""

    rank: int
    world_size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...
    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor: ...
    def reduce_scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor: ...


class DistBackend:
    """Collectives over one torch.distributed process group (None means WORLD).

    A torch.distributed failure (a dead or stalled peer) becomes a TPCompileError naming the
    collective, its graph node and the silent rank (tpcompile.runtime.failures).
    """

    def __init__(self, pg: Any) -> None:
        """Bind the process group and read this process's place in it."""
        self.pg = pg
        self.rank = dist.get_rank(pg)
        self.world_size = dist.get_world_size(pg)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the group into a fresh tensor."""
        out = x.clone(memory_format=torch.contiguous_format)
        if self.world_size > 1:  # a group of one rank (the hybrid runtime at tp = 1) has nothing to exchange
            try:
                dist.all_reduce(out, group=self.pg)
            except RuntimeError as e:
                raise collective_error(e, "all_reduce", x, self.pg) from e
        return out

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every rank's x along dim."""
        x = x.contiguous()
        if self.world_size == 1:
            return x.clone()
        if dim == 0:
            out = x.new_empty((x.shape[0] * self.world_size, *x.shape[1:]))
            try:
                _gather_single(out, x, group=self.pg)
            except RuntimeError as e:
                raise collective_error(e, "all_gather", x, self.pg) from e
            return out
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        try:
            dist.all_gather(parts, x, group=self.pg)
        except RuntimeError as e:
            raise collective_error(e, "all_gather", x, self.pg) from e
        return torch.cat(parts, dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Sum x over the group and keep this rank's chunk along dim."""
        if self.world_size == 1:
            return x.clone(memory_format=torch.contiguous_format)
        shape = list(x.shape)
        shape[dim] //= self.world_size
        out = x.new_empty(shape)
        if dim == 0:
            x_in = x.contiguous()
            try:
                _scatter_single(out, x_in, group=self.pg)
            except RuntimeError as e:
                raise collective_error(e, "reduce_scatter", x, self.pg) from e
            return out
        chunks = [c.contiguous() for c in x.chunk(self.world_size, dim)]
        try:
            dist.reduce_scatter(out, chunks, group=self.pg)
        except RuntimeError as e:
            raise collective_error(e, "reduce_scatter", x, self.pg) from e
        return out


_groups: dict[str, Any] = {}
# Asked in order; the first that returns a backend wins (the simulator registers itself first).
_resolvers: list[Callable[[str], Optional[Backend]]] = []


def register_group(key: str, group: dist.ProcessGroup | int) -> None:
    """Name a torch.distributed ProcessGroup (or, for shape tracing only, an int world size)."""
    if isinstance(group, bool) or (isinstance(group, int) and group < 1):
        raise TPCompileError(f"group {key!r}: a world size must be an int >= 1, got {group!r}")
    _groups[key] = group


def unregister_group(key: str) -> None:
    """Forget the group registered under key, if any."""
    _groups.pop(key, None)


def forget_process_groups() -> None:
    """Unregister every torch.distributed group (destroyed ones must not be kept alive); int world sizes stay."""
    for key in [k for k, g in _groups.items() if not isinstance(g, int)]:
        del _groups[key]


def register_resolver(resolver: Callable[[str], Optional[Backend]]) -> None:
    """Let `resolver(group)` answer, before torch.distributed, which backend the calling thread uses."""
    if resolver not in _resolvers:
        _resolvers.append(resolver)


def _simulated() -> Optional[Backend]:
    """The backend a registered resolver gives the calling thread (a simulated rank), if any."""
    for resolver in _resolvers:
        backend = resolver("")
        if backend is not None:
            return backend
    return None


def current_backend(group: str) -> Backend:
    """The backend that runs collectives of group on the calling thread."""
    sim = _simulated()
    if sim is not None:
        return sim
    if dist.is_available() and dist.is_initialized():
        pg = _groups.get(group)
        if pg is None or isinstance(pg, int):
            if group != "default":
                raise TPCompileError(f"no process group registered under {group!r}; call "
                                     f"tpcompile.ops.collectives.register_group({group!r}, pg)")
            pg = None
        return DistBackend(pg)
    raise TPCompileError(
        f"collective on group {group!r} has no backend: run under torchrun (with "
        f"torch.distributed.init_process_group) or inside tpcompile.simulate / simulate_ranks")


def world_size_of(group: str) -> int:
    """The number of ranks in group (an int registered for tracing counts too)."""
    sim = _simulated()
    if sim is not None:
        return sim.world_size
    registered = _groups.get(group)
    if isinstance(registered, int):
        return registered
    return current_backend(group).world_size


def rank_of(group: str) -> int:
    """The calling rank's index in group."""
    return current_backend(group).rank
