"""Gradient sync for parameters cut into fewer pieces than ranks (kv heads fewer than ranks).

With world size 4 and 2 kv heads, ranks 0-1 hold kv head 0 and ranks 2-3 kv head 1. Each rank's
gradient for its piece covers only its own query heads, so the ranks sharing a piece must sum.
`grad_piece_all_reduce` is the identity in forward; in backward it places the rank's gradient at
its piece in a zero tensor of all pieces, all-reduces that over the world, and keeps its piece:
the sum over exactly the ranks that share it. Forward makes a copy (parameters are small here).
"""
from __future__ import annotations

from typing import Any

import torch

from tpcompile.layouts import holders
from tpcompile.ops.collectives import all_reduce
from tpcompile.runtime.backends import rank_of, world_size_of


@torch.library.custom_op("tpcompile::grad_piece_all_reduce", mutates_args=(),
                         schema="(Tensor x, int dim, int pieces, str group) -> Tensor")
def grad_piece_all_reduce(x: torch.Tensor, dim: int, pieces: int, group: str) -> torch.Tensor:
    """Return x; in backward, sum the gradient over the ranks that hold the same piece."""
    return x.clone()


@grad_piece_all_reduce.register_fake
def _fake(x: torch.Tensor, dim: int, pieces: int, group: str) -> torch.Tensor:
    return torch.empty_like(x)


def _setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.dim, ctx.pieces, ctx.group = inputs[1], inputs[2], inputs[3]


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    ws = world_size_of(ctx.group)
    piece = rank_of(ctx.group) // holders(ws, ctx.pieces)
    shape = list(grad.shape)
    size = shape[ctx.dim]
    shape[ctx.dim] = size * ctx.pieces
    full = grad.new_zeros(shape)
    full.narrow(ctx.dim, piece * size, size).copy_(grad)
    return all_reduce(full, ctx.group).narrow(ctx.dim, piece * size, size), None, None, None


grad_piece_all_reduce.register_autograd(_backward, setup_context=_setup)
