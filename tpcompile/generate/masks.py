"""Attention masks for a static cache: which cached positions each new token may see.

The cache holds `max_seq_len` positions per row; a prompt batch is left-padded (as Hugging Face
`generate` expects), so row b's tokens sit at the same cache positions as every other row's and
its padding is masked out. A new token at cache position p sees position j when row b's token at
j is not padding, j <= p, in a sliding-window layer p - j < window, and in a chunked layer j lies in
p's chunk (chunks counted from the row's first real token, as transformers counts them). The masks enter the graph
as inputs, the same on every rank: the graph never decides what is visible. Their last dim L is
how many cached positions attention reads: the filled part rounded up to a bucket (`bucketed`).

The prompt's masks are built once (`step_masks`); a decode step's masks are kept on the device
for the whole cache and changed in place by one column per step (`advance`): the new position
becomes visible, in a sliding-window layer the one leaving the window hidden, and in a chunked
layer the whole past hidden in the rows where a new chunk begins.
"""
from __future__ import annotations

from typing import Optional

import torch

from tpcompile.generate.locality import Locality

# attention implementations and the mask each takes: a bool "may attend", or an additive float bias
BOOL_MASK, ADDITIVE_MASK = "bool", "additive"


def visible(keep: torch.Tensor, cache_position: torch.Tensor, loc: Locality,
            start: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(B, 1, T, L) bool: query t of row b (at cache_position[t]) may attend cache position j.

    `keep` (B, L) marks the cache positions holding a real token (the attention mask, padded with
    ones up to the cache length); `start` (B,) is each row's first real position (its left padding),
    where a chunked layer's first chunk begins (default: the leading zeros of `keep`).
    """
    j = torch.arange(keep.shape[1], device=keep.device)
    q = cache_position[:, None]  # (T, 1)
    ok = (j[None, :] <= q)[None]  # causal: (1, T, L)
    if loc.window is not None:
        ok = ok & (q - j[None, :] < loc.window)[None]
    if loc.chunk is not None:
        first = left_padding(keep) if start is None else start
        rel_j = j[None, :] - first[:, None]  # (B, L)
        rel_q = cache_position[None, :] - first[:, None]  # (B, T)
        ok = ok & (torch.div(rel_j[:, None, :], loc.chunk, rounding_mode="floor")
                   == torch.div(rel_q[:, :, None], loc.chunk, rounding_mode="floor"))
    return keep[:, None, None, :].bool() & ok[:, None]


def left_padding(keep: torch.Tensor) -> torch.Tensor:
    """(B,) the number of padding positions before each row's first real token (transformers' count)."""
    return (keep.long().cumsum(-1) == 0).sum(-1)


def _values(kind: str, dtype: torch.dtype) -> tuple[object, object]:
    """What a mask of this kind holds where a position is visible, and where it is hidden."""
    return (True, False) if kind == BOOL_MASK else (0.0, torch.finfo(dtype).min)


def as_format(mask: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """The mask in the form an attention implementation adds or selects with."""
    if kind == BOOL_MASK:
        return mask
    # what eager attention adds to its scores: 0 where visible, the dtype's lowest value elsewhere
    return torch.where(mask, torch.zeros((), dtype=dtype), torch.full((), torch.finfo(dtype).min, dtype=dtype))


def step_masks(keep: torch.Tensor, cache_position: torch.Tensor, windows: dict[str, Locality], kind: str,
               dtype: torch.dtype, start: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
    """One mask per kind of layer (name -> Locality), for the tokens at `cache_position`."""
    return {name: as_format(visible(keep, cache_position, loc, start), kind, dtype) for name, loc in windows.items()}


def advance(masks: dict[str, torch.Tensor], position: int, windows: dict[str, Locality], kind: str,
            dtype: torch.dtype, start: Optional[torch.Tensor] = None) -> None:
    """Decode masks (B, 1, 1, max_seq_len) of the token at position - 1 made those of the token at `position`,
    in place: `position` holds a generated token (never padding), a window slides by one, and a row whose
    chunk begins at `position` (start (B,): its first real position) stops seeing the earlier ones."""
    shown, hidden = _values(kind, dtype)
    for name, loc in windows.items():
        column = masks[name][..., position]
        column.fill_(shown)
        if loc.window is not None and position - loc.window >= 0:
            masks[name][..., position - loc.window].fill_(hidden)
        if loc.chunk is not None and start is not None:
            begins = ((position - start) % loc.chunk == 0)[:, None, None, None]  # (B, 1, 1, 1)
            past = masks[name][..., :position]
            past.masked_fill_(begins, hidden)


def bucketed(length: int, bucket: int, max_seq_len: int) -> int:
    """`length` cached positions rounded up to a multiple of `bucket`, at most max_seq_len: few distinct shapes
    (one CUDA graph each) while attention reads at most bucket - 1 positions that hold nothing yet."""
    return min(-(-length // bucket) * bucket, max_seq_len)


def attended_length(masks: dict[str, torch.Tensor]) -> int:
    """How many cached positions attention reads: the masks' last dim (the same for every kind)."""
    return next(iter(masks.values())).shape[-1]
