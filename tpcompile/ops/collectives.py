"""The collective operators that sharded graphs call, as ``torch.ops.tpcompile.<name>``.

Each op is named for what it does in forward and has the Megatron conjugate backward:
all_reduce <-> identity, all_gather <-> reduce_scatter, scatter <-> all_gather,
all_gather_replicated -> own chunk of the gradient, grad_all_reduce -> all_reduce.

grad_all_reduce copies nothing in forward: its schema declares the output a view of the
input (``Tensor(a) -> Tensor(a)``), which ``torch.library.custom_op`` accepts for a
one-tensor view op, so the result shares storage with x. As with any view made inside a
custom autograd function, modifying that result in place while it requires grad raises.
scatter does copy: its chunk along dim is made contiguous for the matmul that follows.

A collective runs on the backend tpcompile.runtime.backends resolves for the calling thread: a
simulated rank (tpcompile.runtime.simulator), else torch.distributed with the group registered
under the group key.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal, Optional

import torch
from torch._subclasses.functional_tensor import FunctionalTensorMode

from tpcompile.errors import TPCompileError
from tpcompile.layouts import token_shares
from tpcompile.ops import shares
from tpcompile.ops.schedule import COLLECTIVE_OPS, FORWARD_COLLECTIVES
from tpcompile.runtime.backends import (
    Backend,
    current_backend,
    rank_of,
    register_group,
    unregister_group,
    world_size_of,
)

__all__ = [
    "COLLECTIVE_OPS", "FORWARD_COLLECTIVES", "CollectiveEvent", "all_gather",
    "all_gather_replicated", "all_reduce", "current_backend", "grad_all_reduce", "rank_of",
    "record", "reduce_scatter", "register_group", "scatter", "unregister_group",
    "world_size_of",
]



@dataclass(frozen=True)
class CollectiveEvent:
    """One executed collective: nbytes and shape describe this rank's input tensor."""

    op: str
    phase: Literal["forward", "backward"]
    rank: int
    nbytes: int
    shape: tuple


_recorders: list[list[CollectiveEvent]] = []
_record_lock = threading.Lock()
# The compiler emits plain int dims, so the schema says int rather than the inferred SymInt.
_DIM_SCHEMA = "(Tensor x, int dim, str group) -> Tensor"
# A gather of a token split passes the gathered size: the ranks' shares may differ by one (layouts/token_shares.py).
_GATHER_SCHEMA = "(Tensor x, int dim, str group, *, SymInt? size=None) -> Tensor"


@contextmanager
def record() -> Iterator[list[CollectiveEvent]]:
    """Collect a CollectiveEvent for every collective executed on any thread meanwhile."""
    events: list[CollectiveEvent] = []
    with _record_lock:
        _recorders.append(events)
    try:
        yield events
    finally:
        with _record_lock:
            _recorders.remove(events)


def _phase() -> Literal["forward", "backward"]:
    """'backward' while the autograd engine runs a backward pass on this thread."""
    return "backward" if torch._C._current_graph_task_id() >= 0 else "forward"


def _run(op: str, x: torch.Tensor, group: str,
         body: Callable[[Backend], torch.Tensor]) -> torch.Tensor:
    """Run body on group's backend, recording the call."""
    backend = current_backend(group)
    if _recorders:
        event = CollectiveEvent(op, _phase(), backend.rank,
                                x.numel() * x.element_size(), tuple(x.shape))
        with _record_lock:
            for events in _recorders:
                events.append(event)
    return body(backend)


def _dim(op: str, x: torch.Tensor, dim: int) -> int:
    """dim normalised to a non-negative index of x, or a TPCompileError naming op."""
    if not -x.dim() <= dim < x.dim():
        raise TPCompileError(f"tpcompile.{op}: dim {dim} is out of range for a {x.dim()}-d tensor")
    return dim % x.dim()


def _share_shape(x: torch.Tensor, dim: int, group: str) -> list:
    """x's shape with dim cut to this rank's share of it (layouts/token_shares.py: any size splits, the first
    size % ws ranks one more). Traced without a rank (a world size registered for tracing), an even share."""
    shape, ws = list(x.shape), world_size_of(group)
    if isinstance(shape[dim], int) and shape[dim] % ws == 0:
        shape[dim] = shape[dim] // ws
        return shape
    try:
        rank = rank_of(group)
    except TPCompileError:
        shape[dim] = shape[dim] // ws
        return shape
    shape[dim] = token_shares.share(shape[dim], rank, ws)
    return shape


def _gather_shares(op: str, x: torch.Tensor, dim: int, size: Optional[int], group: str) -> torch.Tensor:
    """Every rank's x along dim in rank order; with `size`, the ranks hold shares of size entries that may differ by
    one (token_shares): each is sent padded to the largest, and the padding dropped."""
    ws = world_size_of(group)
    if size is None or size == x.shape[dim] * ws:
        return _run(op, x, group, lambda b: b.all_gather(x, dim))
    rank = rank_of(group)
    mine = token_shares.share(size, rank, ws)
    if x.shape[dim] != mine:
        raise TPCompileError(f"tpcompile.{op}: rank {rank} holds {x.shape[dim]} of the {size} entries of dim {dim} "
                             f"split over {ws} ranks, not its share of {mine}: every rank must run on the same "
                             f"inputs (the same batch and sequence length)")
    padded = shares.pad(x.contiguous(), dim, token_shares.slot(size, ws))
    full = _run(op, padded, group, lambda b: b.all_gather(padded, dim))
    return shares.gathered(full, dim, size, ws)


def _own_share(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    """This rank's share of x along dim (a view)."""
    return shares.own(x, dim, rank_of(group), world_size_of(group))


@torch.library.custom_op("tpcompile::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """Sum x over every rank of group."""
    return _run("all_reduce", x, group, lambda b: b.all_reduce(x))


@torch.library.custom_op("tpcompile::all_gather", mutates_args=(), schema=_GATHER_SCHEMA)
def all_gather(x: torch.Tensor, dim: int, group: str, *, size: Optional[int] = None) -> torch.Tensor:
    """Concatenate every rank's x along dim in rank order (`size`: the gathered size, when shares differ)."""
    return _gather_shares("all_gather", x, _dim("all_gather", x, dim), size, group)


@torch.library.custom_op("tpcompile::reduce_scatter", mutates_args=(), schema=_DIM_SCHEMA)
def reduce_scatter(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    """Sum x over ranks and keep this rank's contiguous share along dim (any size: layouts/token_shares.py)."""
    d, ws = _dim("reduce_scatter", x, dim), world_size_of(group)
    if x.shape[d] % ws == 0:
        return _run("reduce_scatter", x, group, lambda b: b.reduce_scatter(x, d))
    padded = shares.padded_shares(x, d, ws)  # shares that differ by one, each sent padded to the largest
    out = _run("reduce_scatter", padded, group, lambda b: b.reduce_scatter(padded, d))
    return shares.first(out, d, token_shares.share(x.shape[d], rank_of(group), ws))


@torch.library.custom_op("tpcompile::all_gather_replicated", mutates_args=(),
                         schema=_GATHER_SCHEMA)
def all_gather_replicated(x: torch.Tensor, dim: int, group: str, *, size: Optional[int] = None) -> torch.Tensor:
    """Concatenate every rank's x along dim; every rank then uses the result identically."""
    return _gather_shares("all_gather_replicated", x, _dim("all_gather_replicated", x, dim), size, group)


@torch.library.custom_op("tpcompile::grad_all_reduce", mutates_args=(),
                         schema="(Tensor(a) x, str group) -> Tensor(a)")
def grad_all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """Return x unchanged (a view, no copy); the gradient is summed over ranks in backward."""
    return x.view_as(x)


@torch.library.custom_op("tpcompile::scatter", mutates_args=(), schema=_DIM_SCHEMA)
def scatter(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    """Keep this rank's contiguous share of x along dim (layouts/token_shares.py), without communicating."""
    return _own_share(x, _dim("scatter", x, dim), group).clone(memory_format=torch.contiguous_format)


# Fake kernels: shapes only, so tracing with fake or symbolic sizes never communicates.
@all_reduce.register_fake
def _all_reduce_fake(x: torch.Tensor, group: str) -> torch.Tensor:
    """The shape of all_reduce: x's."""
    return x.new_empty(x.shape)


@all_gather.register_fake
def _all_gather_fake(x: torch.Tensor, dim: int, group: str, *, size: Optional[int] = None) -> torch.Tensor:
    """The shape of all_gather: `size` along dim, else dim multiplied by the world size."""
    d, shape = _dim("all_gather", x, dim), list(x.shape)
    shape[d] = shape[d] * world_size_of(group) if size is None else size
    return x.new_empty(shape)


@reduce_scatter.register_fake
def _reduce_scatter_fake(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    """The shape of reduce_scatter: dim cut to this rank's share."""
    return x.new_empty(_share_shape(x, _dim("reduce_scatter", x, dim), group))


@grad_all_reduce.register_fake
def _grad_all_reduce_fake(x: torch.Tensor, group: str) -> torch.Tensor:
    """grad_all_reduce is a view of x."""
    return x.view_as(x)


all_gather_replicated.register_fake(_all_gather_fake)
scatter.register_fake(_reduce_scatter_fake)


# Backward rules: the Megatron conjugate of each forward.
def _save_dim_group(ctx: Any, inputs: tuple, output: torch.Tensor, keyword_only_inputs: Any = None) -> None:
    """Keep dim, group and the input's size along dim (a split's whole size) for backward."""
    ctx.dim, ctx.group = _dim("collective", inputs[0], inputs[1]), inputs[2]
    ctx.size = inputs[0].shape[ctx.dim]


def _save_group(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    """Keep group for backward."""
    ctx.group = inputs[1]


def _all_reduce_bwd(ctx: Any, grad: torch.Tensor) -> tuple:
    """all_reduce's output is replicated, so each rank's gradient passes through unchanged."""
    return grad, None


def _all_gather_bwd(ctx: Any, grad: torch.Tensor) -> tuple:
    """Sum the gradient over ranks and keep this rank's share (reduce-scatter)."""
    return reduce_scatter(grad, ctx.dim, ctx.group), None, None


def _reduce_scatter_bwd(ctx: Any, grad: torch.Tensor) -> tuple:
    """Gather every rank's share gradient into the full gradient (all-gather), of the input's size."""
    return all_gather(grad, ctx.dim, ctx.group, size=ctx.size), None, None


def _all_gather_replicated_bwd(ctx: Any, grad: torch.Tensor) -> tuple:
    """Every rank holds the full gradient already; keep this rank's share."""
    return _own_share(grad, ctx.dim, ctx.group), None, None


def _grad_all_reduce_bwd(ctx: Any, grad: torch.Tensor) -> tuple:
    """Sum the partial gradients of the replicated input over ranks."""
    return all_reduce(grad, ctx.group), None


all_reduce.register_autograd(_all_reduce_bwd, setup_context=_save_group)
all_gather.register_autograd(_all_gather_bwd, setup_context=_save_dim_group)
reduce_scatter.register_autograd(_reduce_scatter_bwd, setup_context=_save_dim_group)
all_gather_replicated.register_autograd(_all_gather_replicated_bwd,
                                        setup_context=_save_dim_group)
grad_all_reduce.register_autograd(_grad_all_reduce_bwd, setup_context=_save_group)
scatter.register_autograd(_reduce_scatter_bwd, setup_context=_save_dim_group)


def _grad_all_reduce_functional(mode: Any, x: torch.Tensor, group: str) -> torch.Tensor:
    """Under functionalization grad_all_reduce is exactly aten.alias (backward is traced above)."""
    with mode:
        return torch.ops.aten.alias.default(x)


# torch.compile / aot_autograd reject custom ops returning views; this gives them a functional form.
torch.ops.tpcompile.grad_all_reduce.default.py_impl(FunctionalTensorMode)(
    _grad_all_reduce_functional)
