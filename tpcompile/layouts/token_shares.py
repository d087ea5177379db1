"""Tokens split over the ranks (sequence parallelism): rank r holds one contiguous run of a sequence's T tokens,
the first T % world_size ranks one token more than the others (torch.tensor_split's shares), so any length
splits, balanced to within one token. T is known only at run time; these are the sizes every part of a token
split agrees on: the rewrite's local sizes, the collectives' chunks, the dropout masks' positions.

`share` is one closed form, so it holds for ints, torch.SymInts and sympy sizes alike; `start` and `slot` are
for the run-time ints. A split dim may hold k entries per token (a router's top-k choices, flattened with the
tokens): `tokens_of` reads the tokens and k off the dim's size, and a rank holds k entries per token it holds.
"""
from __future__ import annotations

from typing import Any

import sympy


def share(total: Any, rank: int, world_size: int) -> Any:
    """How many of `total` tokens `rank` holds: ceil((total - rank) / world_size)."""
    return (total + (world_size - 1 - rank)) // world_size


def start(total: int, rank: int, world_size: int) -> int:
    """The index of the first token `rank` holds."""
    q, k = divmod(total, world_size)
    return rank * q + min(rank, k)


def slot(total: int, world_size: int) -> int:
    """The most tokens any rank holds (rank 0's share): what each rank sends when shares are padded to one size."""
    return -(-total // world_size)


def shares(total: int, world_size: int) -> list[int]:
    """Every rank's share, in rank order."""
    return [share(total, r, world_size) for r in range(world_size)]


def tokens_of(block: Any) -> tuple[Any, int]:
    """(tokens, entries per token) of one sequence's block of a token-split dim: a run-time size k * T is T tokens
    of k entries; a fixed size is that many tokens of one entry."""
    if isinstance(block, int):
        return block, 1
    coeff, rest = sympy.sympify(block).as_coeff_Mul()
    if coeff.is_Integer and int(coeff) > 1 and not rest.is_number:
        return rest, int(coeff)
    return block, 1
