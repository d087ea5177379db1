"""The asynchronous all-reduce: ``torch.ops.tpcompile.all_reduce.start`` and ``torch.ops.tpcompile_async.wait``.

`all_reduce.start(x, group)` launches the sum of x over the ranks into x's own storage and
returns x at once (its contents are undefined until the wait); `tpcompile_async.wait(x)`
blocks until that sum is in x and returns x. Between the two the rank computes whatever does
not depend on the sum: the overlap. Only passes/comm_async.py emits the pair, and only for an
all-reduce the in-place pass has already proven may overwrite its input (a dead temporary),
with nothing but the wait reading x in between.

The start is an overload of all_reduce, so schedules and counts read one all-reduce; the wait
is outside the collectives' namespace (it communicates nothing). Under torch.distributed the
start is `dist.all_reduce(x, async_op=True)` and the work handle waits for the wait; on a
simulated rank (and for a non-contiguous x) the sum runs at the start and the wait does nothing.
Autograd: both mark x dirty and pass the gradient through (all_reduce's backward).
"""
from __future__ import annotations

import threading

import torch
import torch.distributed as dist
from torch.library import Library

from tpcompile.ops.inplace import dirty_autograd  # (and all_reduce.inplace, the start's synchronous form)
from tpcompile.ops.collectives import _run
from tpcompile.runtime.backends import Backend, DistBackend
from tpcompile.runtime.failures import collective_error

__all__ = ["all_reduce_start", "wait"]

_lib = Library("tpcompile", "FRAGMENT")
_lib.define("all_reduce.start(Tensor(a!) x, str group) -> Tensor(a!)")
_wait_lib = Library("tpcompile_async", "DEF")
_wait_lib.define("wait(Tensor(a!) x) -> Tensor(a!)")

_pending = threading.local()  # per thread (simulated ranks are threads): id(x) -> (work handle, x, group)


def _works() -> dict:
    if not hasattr(_pending, "works"):
        _pending.works = {}
    return _pending.works


def _launch(backend: Backend, x: torch.Tensor) -> torch.Tensor:
    if isinstance(backend, DistBackend) and x.is_contiguous():
        try:
            _works()[id(x)] = (dist.all_reduce(x, group=backend.pg, async_op=True), x, backend.pg)
        except RuntimeError as e:  # a peer already gone (gloo fails the launch itself then)
            raise collective_error(e, "all_reduce.start", x, backend.pg) from e
        return x
    return x.copy_(backend.all_reduce(x.clone()))


def _start_kernel(x: torch.Tensor, group: str) -> torch.Tensor:
    """Launch the in-place sum of x over group's ranks."""
    return _run("all_reduce", x, group, lambda b: _launch(b, x))


def _wait_kernel(x: torch.Tensor) -> torch.Tensor:
    """Block until the sum launched into x has landed."""
    entry = _works().pop(id(x), None)
    if entry is not None:
        try:
            entry[0].wait()
        except RuntimeError as e:  # the sum failed in flight: a dead or stalled peer
            raise collective_error(e, "all_reduce.start (at its wait)", x, entry[2]) from e
    return x


_lib.impl("all_reduce.start", _start_kernel, "CompositeExplicitAutograd")
_lib.impl("all_reduce.start", lambda x, group: dirty_autograd(x, torch.ops.tpcompile.all_reduce.start, group),
          "Autograd")
torch.library.register_fake("tpcompile::all_reduce.start", lambda x, group: x, lib=_lib)
_wait_lib.impl("wait", _wait_kernel, "CompositeExplicitAutograd")
_wait_lib.impl("wait", lambda x: dirty_autograd(x, torch.ops.tpcompile_async.wait.default), "Autograd")
torch.library.register_fake("tpcompile_async::wait", lambda x: x, lib=_wait_lib)

all_reduce_start = torch.ops.tpcompile.all_reduce.start
wait = torch.ops.tpcompile_async.wait.default
