"""Tensors split in shares that may differ by one entry (layouts/token_shares.py): what a collective sends and keeps.

Backends exchange equal blocks, so each share is sent zero-padded to the largest (`padded_shares`, `pad`) and the
padding is dropped from what comes back (`gathered`, `first`). `own` is a rank's share of a whole tensor; `owned`
makes a collective's result a tensor of its own, never a view of the buffer it came in. The tpcompile
collectives (collectives.py) and their torch.compile spelling (c10d.py) both cut tensors here.
"""
from __future__ import annotations

import torch

from tpcompile.layouts.token_shares import share, slot, start


def own(x: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    """`rank`'s share of x along dim (a view)."""
    total = x.shape[dim]
    return x.narrow(dim, start(total, rank, world_size), share(total, rank, world_size))


def owned(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of view x: a collective's result taken out of a larger buffer (a narrowed padded share, a
    gathered dim moved back) would be a view, which autograd refuses to let a later in-place op modify."""
    return x.clone(memory_format=torch.contiguous_format)


def first(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """The first n entries of x along dim (a share out of its padded slot), a tensor of its own: x itself when it
    has no more."""
    return x if n == x.shape[dim] else owned(x.narrow(dim, 0, n))


def pad(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """x zero-padded along dim to n entries (x itself when it has them)."""
    if x.shape[dim] == n:
        return x
    return torch.nn.functional.pad(x, [0, 0] * (x.dim() - dim - 1) + [0, n - x.shape[dim]])


def padded_shares(x: torch.Tensor, dim: int, world_size: int) -> torch.Tensor:
    """x with every rank's share along dim zero-padded to the largest: world_size equal blocks in rank order."""
    n = slot(x.shape[dim], world_size)
    return torch.cat([pad(own(x, dim, r, world_size), dim, n) for r in range(world_size)], dim)


def gathered(full: torch.Tensor, dim: int, size: int, world_size: int) -> torch.Tensor:
    """The `size` real entries of world_size padded shares gathered along dim, in order."""
    n = slot(size, world_size)
    return torch.cat([full.narrow(dim, r * n, share(size, r, world_size)) for r in range(world_size)], dim)
