"""One gradient all-reduce for a bucket of parameters: ``torch.ops.tpcompile.grad_bucket_all_reduce``.

Forward returns each tensor of the bucket unchanged (a copy: a custom op cannot return
several views). Backward runs once, when every member's gradient is ready: each gradient
(or, for a parameter cut into fewer pieces than ranks, the gradient placed at its piece in
zeros of all pieces, as `grad_piece_all_reduce` does) is flattened into one buffer, the
buffer is all-reduced once (in place: it is a fresh temporary), and each member takes its
part back. The sums are the per-member all-reduces' sums, in one collective.

`pieces[i] == 0` marks a plain sum over the group (a replicated parameter's partial gradient,
what `grad_all_reduce` does per parameter); `pieces[i] = g > 0` sums over the ranks sharing
piece `rank // (world_size / g)` along `dims[i]`.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

import tpcompile.ops.inplace  # noqa: F401  (the in-place all-reduce the backward uses)
from tpcompile.layouts import holders
from tpcompile.runtime.backends import rank_of, world_size_of

__all__ = ["grad_bucket_all_reduce"]


@torch.library.custom_op("tpcompile::grad_bucket_all_reduce", mutates_args=(),
                         schema="(Tensor[] xs, int[] dims, int[] pieces, str group) -> Tensor[]")
def grad_bucket_all_reduce(xs: list[torch.Tensor], dims: list[int], pieces: list[int],
                           group: str) -> list[torch.Tensor]:
    """Return xs; in backward, sum all their gradients over ranks with one all-reduce."""
    return [x.clone() for x in xs]


@grad_bucket_all_reduce.register_fake
def _fake(xs: list[torch.Tensor], dims: list[int], pieces: list[int], group: str) -> list[torch.Tensor]:
    return [torch.empty_like(x) for x in xs]


def _setup(ctx: Any, inputs: tuple, output: Any) -> None:
    xs, ctx.dims, ctx.pieces, ctx.group = inputs
    ctx.like = [(tuple(x.shape), x.dtype, x.device) for x in xs]


def _contribution(g: torch.Tensor, dim: int, pieces: int, piece: int) -> torch.Tensor:
    """What this rank adds to the sum: the gradient, or it placed at its piece in zeros of all pieces."""
    if not pieces:
        return g.reshape(-1)
    shape = list(g.shape)
    size = shape[dim]
    shape[dim] = size * pieces
    full = g.new_zeros(shape)
    full.narrow(dim, piece * size, size).copy_(g)
    return full.reshape(-1)


def _backward(ctx: Any, grads: list[Optional[torch.Tensor]]) -> tuple:
    ws, rank = world_size_of(ctx.group), rank_of(ctx.group)
    parts, pieces_of = [], []
    for g, (shape, dtype, device), dim, p in zip(grads, ctx.like, ctx.dims, ctx.pieces):
        g = torch.zeros(shape, dtype=dtype, device=device) if g is None else g
        piece = rank // holders(ws, p) if p else 0
        parts.append(_contribution(g, dim, p, piece))
        pieces_of.append(piece)
    flat = torch.ops.tpcompile.all_reduce.inplace(torch.cat(parts), ctx.group)
    out, at = [], 0
    for part, (shape, _, _), dim, p, piece in zip(parts, ctx.like, ctx.dims, ctx.pieces, pieces_of):
        chunk = flat.narrow(0, at, part.numel())
        at += part.numel()
        if not p:
            out.append(chunk.view(shape))
            continue
        full = list(shape)
        full[dim] = shape[dim] * p
        out.append(chunk.view(full).narrow(dim, piece * shape[dim], shape[dim]))
    return out, None, None, None


grad_bucket_all_reduce.register_autograd(_backward, setup_context=_setup)
