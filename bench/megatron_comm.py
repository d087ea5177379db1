"""Megatron's communication operators on plain tensors and torch.distributed, with a call log.

copy: identity forward, all-reduce backward (the input of a column split);
all_reduce: all-reduce forward, identity backward (the output of a row split);
all_gather_last: all-gather along the last dim forward, own slice of the gradient backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CommLog"]


class _Copy(torch.autograd.Function):
    """Identity forward; the gradient is summed over ranks in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, log: "CommLog") -> torch.Tensor:
        """x unchanged."""
        ctx.log = log
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        """All-reduce the partial gradient."""
        grad = grad.contiguous()
        ctx.log.calls.append(("all_reduce", grad.numel() * grad.element_size()))
        dist.all_reduce(grad)
        return grad, None


class _Reduce(torch.autograd.Function):
    """Sum over ranks in place forward (the input is a fresh matmul output); identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, log: "CommLog") -> torch.Tensor:
        """x summed over ranks, in x's own storage."""
        log.calls.append(("all_reduce", x.numel() * x.element_size()))
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        """The gradient of a replicated output passes through."""
        return grad, None


class _GatherLast(torch.autograd.Function):
    """Concatenate every rank's x along the last dim; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, log: "CommLog") -> torch.Tensor:
        """Every rank's x, concatenated along the last dim."""
        x = x.contiguous()
        log.calls.append(("all_gather", x.numel() * x.element_size()))
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x)
        ctx.width = x.shape[-1]
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        """This rank's slice of the full gradient."""
        return grad.narrow(-1, dist.get_rank() * ctx.width, ctx.width), None


class CommLog:
    """The collectives a hand-written rank issued: (op, bytes of this rank's input tensor)."""

    def __init__(self) -> None:
        """Start empty."""
        self.calls: list[tuple[str, int]] = []

    def copy(self, x: torch.Tensor) -> torch.Tensor:
        """x, whose gradient is all-reduced in backward (no forward communication)."""
        return _Copy.apply(x, self) if torch.is_grad_enabled() else x

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x in place over every rank and log the call."""
        return _Reduce.apply(x, self)

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dim and log the call."""
        return _GatherLast.apply(x, self)

    def clear(self) -> None:
        """Forget every logged call."""
        self.calls.clear()

    def counts(self) -> dict[str, int]:
        """Number of logged calls per op."""
        out: dict[str, int] = {}
        for op, _ in self.calls:
            out[op] = out.get(op, 0) + 1
        return out

    def nbytes(self) -> int:
        """Total input bytes of the logged calls."""
        return sum(n for _, n in self.calls)
