"""Random streams for dropout in sharded graphs.

Each rank has two generators. The replicated stream is seeded alike on every rank, so dropout
on a replicated value draws the same mask everywhere and the ranks' copies stay equal. The
sharded stream is seeded per rank, so dropout on a rank's own heads, features or tokens draws
a mask of its own (as separate devices would). `seed(s)` resets both streams on every rank;
the default seed is 0. The masks come from these generators, not from torch's global one, so
simulated ranks on threads are reproducible too.
"""
from __future__ import annotations

import threading

import torch

from tpcompile.runtime.backends import rank_of, world_size_of

_SHARDED_OFFSET = 2718  # keeps the per-rank streams away from the replicated one
_lock = threading.Lock()
_base_seed = 0
_generators: dict[tuple, torch.Generator] = {}


def seed(value: int) -> None:
    """Reseed every rank's replicated and sharded dropout streams."""
    global _base_seed
    with _lock:
        _base_seed = int(value)
        _generators.clear()


def generator(stream: str, rank: int, world_size: int, device: torch.device) -> torch.Generator:
    """The generator of one stream on one rank, created on first use."""
    key = (stream, rank, world_size, str(device))
    with _lock:
        if key not in _generators:
            g = torch.Generator(device=device)
            offset = 0 if stream == "replicated" else _SHARDED_OFFSET + rank
            g.manual_seed(_base_seed + offset)
            _generators[key] = g
        return _generators[key]


@torch.library.custom_op("tpcompile_rng::dropout_mask", mutates_args=())
def dropout_mask(x: torch.Tensor, p: float, stream: str, group: str) -> torch.Tensor:
    """A mask of 0 and 1/(1-p) shaped like x, drawn from this rank's `stream` generator."""
    g = generator(stream, rank_of(group), world_size_of(group), x.device)
    keep = torch.empty(x.shape, device=x.device, dtype=torch.float32).uniform_(0.0, 1.0, generator=g) >= p
    return keep.to(x.dtype) / (1.0 - p)


@dropout_mask.register_fake
def _dropout_mask_fake(x: torch.Tensor, p: float, stream: str, group: str) -> torch.Tensor:
    return torch.empty_like(x)


def _no_grad(ctx: object, grad: torch.Tensor) -> tuple:
    return None, None, None, None


dropout_mask.register_autograd(_no_grad)
