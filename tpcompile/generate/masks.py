"""Attention masks for a static cache: which cached positions each new token may see.

The cache holds `max_seq_len` positions per row; a prompt batch is left-padded (as Hugging Face
`generate` expects), so row b's tokens sit at the same cache positions as every other row's and
its padding is masked out. A new token at cache position p sees position j when row b's token at
j is not padding, j <= p, and (sliding-window layers) p - j < window. The masks enter the graph
as inputs, the same on every rank: the graph never decides what is visible. Their last dim L is
how many cached positions attention reads: the filled part rounded up to a bucket (`bucketed`).

The prompt's masks are built once (`step_masks`); a decode step's masks are kept on the device
for the whole cache and changed in place by one column per step (`advance`): the new position
becomes visible and, in a sliding-window layer, the one leaving the window hidden.
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


def _values(kind: str, dtype: torch.dtype) -> tuple[object, object]:
    """What a mask of this kind holds where a position is visible, and where it is hidden."""
    return (True, False) if kind == BOOL_MASK else (0.0, torch.finfo(dtype).min)


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


def advance(masks: dict[str, torch.Tensor], position: int, windows: dict[str, Optional[int]], kind: str,
            dtype: torch.dtype) -> None:
    """Decode masks (B, 1, 1, max_seq_len) of the token at position - 1 made those of the token at `position`,
    in place: `position` holds a generated token (never padding), and a window slides by one."""
    shown, hidden = _values(kind, dtype)
    for name, w in windows.items():
        column = masks[name][..., position]
        column.fill_(shown)
        if w is not None and position - w >= 0:
            masks[name][..., position - w].fill_(hidden)


def bucketed(length: int, bucket: int, max_seq_len: int) -> int:
    """`length` cached positions rounded up to a multiple of `bucket`, at most max_seq_len: few distinct shapes
    (one CUDA graph each) while attention reads at most bucket - 1 positions that hold nothing yet."""
    return min(-(-length // bucket) * bucket, max_seq_len)


def attended_length(masks: dict[str, torch.Tensor]) -> int:
    """How many cached positions attention reads: the masks' last dim (the same for every kind)."""
    return next(iter(masks.values())).shape[-1]
