"""The in-place overload of the all-reduce: ``torch.ops.tpcompile.all_reduce.inplace``.

Same op name and group argument as ``all_reduce`` (a second overload of it), so schedules,
counts and the verifier read it as an all-reduce. It sums x over the ranks into x's own
storage and returns x: no output buffer and no copy. Only passes/comm_inplace.py emits it,
for an input it has proven to be a dead temporary (no other reader, not a graph input or
parameter, not a view, not saved by its producer for backward).

Autograd: as all_reduce, the gradient passes through unchanged; the op marks x dirty, so
autograd moves x's history onto it (and raises, as for any in-place op, if x were saved).
Under torch.distributed the sum runs in x itself (``dist.all_reduce`` on a contiguous x);
on a simulated rank x is deposited as a copy, so no rank overwrites what another still reads.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.library import Library

from tpcompile.ops.collectives import _run
from tpcompile.runtime.backends import Backend, DistBackend
from tpcompile.runtime.failures import collective_error

__all__ = ["all_reduce_inplace"]

_lib = Library("tpcompile", "FRAGMENT")
_lib.define("all_reduce.inplace(Tensor(a!) x, str group) -> Tensor(a!)")


def _sum_into(backend: Backend, x: torch.Tensor) -> torch.Tensor:
    """x summed over the backend's ranks, written into x."""
    if isinstance(backend, DistBackend) and x.is_contiguous():
        try:
            dist.all_reduce(x, group=backend.pg)
        except RuntimeError as e:  # a dead or stalled peer, told with the graph node and the silent rank
            raise collective_error(e, "all_reduce.inplace", x, backend.pg) from e
        return x
    return x.copy_(backend.all_reduce(x.clone()))


def _kernel(x: torch.Tensor, group: str) -> torch.Tensor:
    """Sum x over every rank of group, in place."""
    return _run("all_reduce", x, group, lambda b: _sum_into(b, x))


def _fake(x: torch.Tensor, group: str) -> torch.Tensor:
    """Shapes only: the result is x itself."""
    return x


class _Dirty(torch.autograd.Function):
    """Run an in-place kernel below autograd, mark x dirty: x's history continues; the gradient passes through."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, op: Any, *args: Any) -> torch.Tensor:
        with torch._C._AutoDispatchBelowAutograd():
            op(x, *args)
        ctx.mark_dirty(x)
        ctx.n = len(args)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return (grad, None) + (None,) * ctx.n


def dirty_autograd(x: torch.Tensor, op: Any, *args: Any) -> torch.Tensor:
    """The Autograd kernel of an in-place op(x, *args) (this one, the async start and wait): through _Dirty
    when x carries a gradient, else the kernel at once below autograd, x's version bumped as any in-place op's."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _Dirty.apply(x, op, *args)
    with torch._C._AutoDispatchBelowAutograd():
        op(x, *args)
    if not x.is_inference():
        torch.autograd.graph.increment_version(x)
    return x


def _functional(x: torch.Tensor, group: str) -> torch.Tensor:
    """Under functionalization (torch.compile's AOT autograd): the out-of-place sum, written back into x, which
    the compiler turns into a mutation of the graph's own buffer."""
    x.copy_(torch.ops.tpcompile.all_reduce.default(x, group))
    return x


_lib.impl("all_reduce.inplace", _kernel, "CompositeExplicitAutograd")
_lib.impl("all_reduce.inplace", _functional, "Functionalize")
_lib.impl("all_reduce.inplace", lambda x, group: dirty_autograd(x, torch.ops.tpcompile.all_reduce.inplace, group),
          "Autograd")
torch.library.register_fake("tpcompile::all_reduce.inplace", _fake, lib=_lib)

all_reduce_inplace = torch.ops.tpcompile.all_reduce.inplace
