"""Attention masks for a static cache: which cached positions each new token may see.

The cache holds `max_seq_len` positions per row; a prompt batch is left-padded (as Hugging Face
`generate` expects), so row b's tokens sit at the same cache positions as every other row's and
its padding is masked out. A new token at cache position p sees position j when row b's token at
j is not padding, j <= p, and (sliding-window layers) p - j < window. The masks are built on the
host each step, the same on every rank, and enter the graph as inputs: the graph never decides
what is visible.
"""
from __future__ import annotations

from typing import Optional

import torch

# attention implementations and the mask each takes: a bool "may attend", or an additive float bias
BOOL_MASK, ADDITIVE_MASK = "bool", "additive"


def visible(keep: torch.Tensor, cache_position: torch.Tensor, window: Optional[int]) -> torch.Tensor:
    """(B, 1, T, L) bool: query t of row b (at cache_position[t]) may attend cache position j.

    `keep` (B, L) marks the cache positions holding a real token (the attention mask, padded with
    ones up to the cache length).
    """
    j = torch.arange(keep.shape[1], device=keep.device)
    q = cache_position[:, None]  # (T, 1)
    ok = j[None, :] <= q  # causal: (T, L)
    if window is not None:
        ok = ok & (q - j[None, :] < window)
    return keep[:, None, None, :].bool() & ok[None, None]


def as_format(mask: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """The mask in the form an attention implementation adds or selects with."""
    if kind == BOOL_MASK:
        return mask
    # what eager attention adds to its scores: 0 where visible, the dtype's lowest value elsewhere
    return torch.where(mask, torch.zeros((), dtype=dtype), torch.full((), torch.finfo(dtype).min, dtype=dtype))


def step_masks(keep: torch.Tensor, cache_position: torch.Tensor, windows: dict[str, Optional[int]], kind: str,
               dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One mask per kind of layer (name -> sliding window or None), for the tokens at `cache_position`."""
    return {name: as_format(visible(keep, cache_position, w), kind, dtype) for name, w in windows.items()}
