"""tpcompile's collectives spelled with ``torch.ops._c10d_functional``, for torch.compile.

passes/comm_lower.py replaces every ``torch.ops.tpcompile.*`` node of a rank graph with one of
the functions below. Each is a ``torch.autograd.Function`` whose forward and backward call
the functional collectives (``all_reduce``, ``all_gather_into_tensor``,
``reduce_scatter_tensor``, each followed by ``wait_tensor``), with the same Megatron conjugate
backward as the tpcompile op it replaces. Dynamo traces them, so aot_autograd's forward and
backward graphs hold ``_c10d_functional`` nodes that inductor's communication passes
(reordering, bucketing, overlap) understand. The group is a torch.distributed group name and
the rank and world size are constants of the lowered graph: lowering needs an initialised
process group and binds the graph to it.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from tpcompile.errors import TPCompileError
from tpcompile.layouts import holders
from tpcompile.layouts.token_shares import share, slot
from tpcompile.ops import shares
from tpcompile.runtime.failures import collective_error

__all__ = ["LOWERED"]

c10d = torch.ops._c10d_functional


def _failure(error: RuntimeError, op: str, x: torch.Tensor, group: str) -> TPCompileError:
    """The TPCompileError for a failed functional collective, its group looked up by name (failure path only)."""
    try:
        pg = torch.distributed.distributed_c10d._resolve_process_group(group)
    except (RuntimeError, ValueError, KeyError):
        pg = None
    return collective_error(error, op, x, pg)


def _sum(x: torch.Tensor, group: str) -> torch.Tensor:
    """x summed over ranks."""
    try:
        return c10d.wait_tensor(c10d.all_reduce(x.contiguous(), "sum", group))
    except RuntimeError as e:  # run eagerly, a dead or stalled peer; compiled code raises torch's own error
        raise _failure(e, "all_reduce", x, group) from e


def _gather(x: torch.Tensor, dim: int, ws: int, group: str) -> torch.Tensor:
    """Every rank's x concatenated along dim (gathered on dim 0, then laid out along dim)."""
    moved = x.movedim(dim, 0).contiguous()
    try:
        out = c10d.wait_tensor(c10d.all_gather_into_tensor(moved, ws, group))
    except RuntimeError as e:
        raise _failure(e, "all_gather", x, group) from e
    return out if dim == 0 else shares.owned(out.movedim(0, dim))


def _scatter_sum(x: torch.Tensor, dim: int, ws: int, group: str) -> torch.Tensor:
    """x summed over ranks, this rank's chunk along dim."""
    moved = x.movedim(dim, 0).contiguous()
    try:
        out = c10d.wait_tensor(c10d.reduce_scatter_tensor(moved, "sum", ws, group))
    except RuntimeError as e:
        raise _failure(e, "reduce_scatter", x, group) from e
    return out if dim == 0 else shares.owned(out.movedim(0, dim))


def _gather_shares(x: torch.Tensor, dim: int, ws: int, group: str, size: Optional[int]) -> torch.Tensor:
    """_gather of shares of `size` entries that may differ by one (ops/shares.py): sent padded, the padding dropped."""
    if size is None or size == x.shape[dim] * ws:
        return _gather(x, dim, ws, group)
    return shares.gathered(_gather(shares.pad(x, dim, slot(size, ws)), dim, ws, group), dim, size, ws)


def _scatter_shares(x: torch.Tensor, dim: int, rank: int, ws: int, group: str) -> torch.Tensor:
    """_scatter_sum of any size along dim: this rank's share (ops/shares.py)."""
    if x.shape[dim] % ws == 0:
        return _scatter_sum(x, dim, ws, group)
    out = _scatter_sum(shares.padded_shares(x, dim, ws), dim, ws, group)
    return shares.first(out, dim, share(x.shape[dim], rank, ws))


class AllReduce(torch.autograd.Function):
    """all_reduce (and all_reduce.inplace): sum in forward, identity in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: str) -> torch.Tensor:
        return _sum(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad, None


class GradAllReduce(torch.autograd.Function):
    """grad_all_reduce: identity in forward, sum of the gradient in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: str) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _sum(grad, ctx.group), None


class AllGather(torch.autograd.Function):
    """all_gather: gather in forward, reduce-scatter in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, rank: int, ws: int, group: str,
                size: Optional[int] = None) -> torch.Tensor:
        ctx.dim, ctx.rank, ctx.ws, ctx.group = dim, rank, ws, group
        return _gather_shares(x, dim, ws, group, size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _scatter_shares(grad, ctx.dim, ctx.rank, ctx.ws, ctx.group), None, None, None, None, None


class AllGatherReplicated(torch.autograd.Function):
    """all_gather_replicated: gather in forward, this rank's share of the gradient in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, rank: int, ws: int, group: str,
                size: Optional[int] = None) -> torch.Tensor:
        ctx.dim, ctx.rank, ctx.ws = dim, rank, ws
        return _gather_shares(x, dim, ws, group, size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return shares.own(grad, ctx.dim, ctx.rank, ctx.ws), None, None, None, None, None


class ReduceScatter(torch.autograd.Function):
    """reduce_scatter: reduce-scatter in forward, gather in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, rank: int, ws: int, group: str) -> torch.Tensor:
        ctx.dim, ctx.ws, ctx.group, ctx.size = dim, ws, group, x.shape[dim]
        return _scatter_shares(x, dim, rank, ws, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _gather_shares(grad, ctx.dim, ctx.ws, ctx.group, ctx.size), None, None, None, None


class Scatter(torch.autograd.Function):
    """scatter: this rank's share in forward (no communication), gather in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, rank: int, ws: int, group: str) -> torch.Tensor:
        ctx.dim, ctx.ws, ctx.group, ctx.size = dim, ws, group, x.shape[dim]
        return shares.own(x, dim, rank, ws).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _gather_shares(grad, ctx.dim, ctx.ws, ctx.group, ctx.size), None, None, None, None


def _piece_sum(grads: list[torch.Tensor], dims: list[int], pieces: list[int], rank: int, ws: int,
               group: str) -> list[torch.Tensor]:
    """Each gradient summed over the ranks sharing its piece (all ranks when pieces is 0), one all-reduce."""
    parts, placed = [], []
    for g, dim, p in zip(grads, dims, pieces):
        if not p:
            parts.append(g.reshape(-1))
            placed.append(None)
            continue
        piece, size = rank // holders(ws, p), g.shape[dim]
        pads = [0, 0] * (g.dim() - dim - 1) + [piece * size, (p - 1 - piece) * size]
        parts.append(torch.nn.functional.pad(g, pads).reshape(-1))
        placed.append((piece, size))
    flat = _sum(torch.cat(parts), group)
    out, at = [], 0
    for g, part, dim, p, where in zip(grads, parts, dims, pieces, placed):
        chunk = flat.narrow(0, at, part.numel())
        at += part.numel()
        if where is None:
            out.append(chunk.view(g.shape))
        else:
            full = list(g.shape)
            full[dim] = g.shape[dim] * p
            out.append(chunk.view(full).narrow(dim, where[0] * where[1], where[1]))
    return out


class GradPieceAllReduce(torch.autograd.Function):
    """grad_piece_all_reduce: identity in forward, the piece's gradient summed over its ranks in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, pieces: int, rank: int, ws: int, group: str) -> torch.Tensor:
        ctx.args = (dim, pieces, rank, ws, group)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        dim, pieces, rank, ws, group = ctx.args
        return _piece_sum([grad], [dim], [pieces], rank, ws, group)[0], None, None, None, None, None


class GradBucketAllReduce(torch.autograd.Function):
    """grad_bucket_all_reduce: identity in forward, the bucket's gradients summed with one all-reduce."""

    @staticmethod
    def forward(ctx: Any, dims: list, pieces: list, rank: int, ws: int, group: str, *xs: torch.Tensor) -> tuple:
        ctx.args = (dims, pieces, rank, ws, group)
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        dims, pieces, rank, ws, group = ctx.args
        return (None,) * 5 + tuple(_piece_sum(list(grads), dims, pieces, rank, ws, group))


class LinearsGradAllReduce(torch.autograd.Function):
    """linears_grad_all_reduce: the linears in forward; x's gradient all-reduced, the weights' computed."""

    @staticmethod
    def forward(ctx: Any, has_bias: list, group: str, x: torch.Tensor, *params: torch.Tensor) -> tuple:
        n = len(has_bias)
        weights, present = params[:n], iter(params[n:])
        biases = [next(present) if b else None for b in has_bias]
        ctx.group, ctx.has_bias = group, has_bias
        ctx.save_for_backward(x, *weights)
        return tuple(torch.nn.functional.linear(x, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        x, *weights = ctx.saved_tensors
        gi = sum(g.matmul(w.to(g.dtype)).to(x.dtype) for g, w in zip(grads, weights))
        x2 = x.reshape(-1, x.shape[-1])
        g2s = [g.reshape(-1, g.shape[-1]) for g in grads]
        gws = tuple(g2.t().mm(x2.to(g2.dtype)).to(w.dtype) for g2, w in zip(g2s, weights))
        gbs = tuple(g2.sum(0).to(w.dtype) for g2, w, b in zip(g2s, weights, ctx.has_bias) if b)
        return (None, None, _sum(gi, ctx.group)) + gws + gbs


def linears_grad_all_reduce(tensors: list, has_bias: list, group: str) -> list:
    """The linears; x's gradient summed over ranks (inductor may overlap it with the weights' gradients)."""
    return list(LinearsGradAllReduce.apply(list(has_bias), group, *tensors))


def all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """The sum over ranks; identity backward."""
    return AllReduce.apply(x, group)


def grad_all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """x; the gradient summed in backward."""
    return GradAllReduce.apply(x, group)


def all_gather(x: torch.Tensor, dim: int, rank: int, ws: int, group: str, *,
               size: Optional[int] = None) -> torch.Tensor:
    """Every rank's x along dim (`size` of it, when shares differ); reduce-scatter backward."""
    return AllGather.apply(x, dim, rank, ws, group, size)


def all_gather_replicated(x: torch.Tensor, dim: int, rank: int, ws: int, group: str, *,
                          size: Optional[int] = None) -> torch.Tensor:
    """Every rank's x along dim (`size` of it, when shares differ); own share of the gradient backward."""
    return AllGatherReplicated.apply(x, dim, rank, ws, group, size)


def reduce_scatter(x: torch.Tensor, dim: int, rank: int, ws: int, group: str) -> torch.Tensor:
    """This rank's chunk of the sum; gather backward."""
    return ReduceScatter.apply(x, dim, rank, ws, group)


def scatter(x: torch.Tensor, dim: int, rank: int, ws: int, group: str) -> torch.Tensor:
    """This rank's chunk; gather backward."""
    return Scatter.apply(x, dim, rank, ws, group)


def grad_piece_all_reduce(x: torch.Tensor, dim: int, pieces: int, rank: int, ws: int, group: str) -> torch.Tensor:
    """x; its piece's gradient summed over the ranks sharing it."""
    return GradPieceAllReduce.apply(x, dim, pieces, rank, ws, group)


def grad_bucket_all_reduce(xs: list, dims: list, pieces: list, rank: int, ws: int, group: str) -> list:
    """xs; their gradients summed with one all-reduce."""
    return list(GradBucketAllReduce.apply(dims, pieces, rank, ws, group, *xs))


# tpcompile op name -> (lowered function, whether it takes rank and world size after its own arguments)
LOWERED = {
    "all_reduce": (all_reduce, False), "grad_all_reduce": (grad_all_reduce, False),
    "all_gather": (all_gather, True), "all_gather_replicated": (all_gather_replicated, True),
    "reduce_scatter": (reduce_scatter, True), "scatter": (scatter, True),
    "grad_piece_all_reduce": (grad_piece_all_reduce, True), "grad_bucket_all_reduce": (grad_bucket_all_reduce, True),
    "linears_grad_all_reduce": (linears_grad_all_reduce, False),
}
