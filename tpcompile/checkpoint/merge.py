"""Put the ranks' parameter slices back together into the original model's state dict."""
from __future__ import annotations

from typing import Any, Optional

import torch

from tpcompile.errors import TPCompileError
from tpcompile.placement import rank_pieces


def merge_slices(pieces: list[torch.Tensor], sl: Any, full_size: int, world_size: int) -> torch.Tensor:
    """The whole tensor from every rank's slice (the inverse of rewrite.local_tensor)."""
    if sl is None:
        return pieces[0].detach().clone()
    # the ranks' runs tile the whole tensor (checked by verify); ranks sharing a piece write it alike
    out = pieces[0].new_empty([full_size if d == sl.dim else s for d, s in enumerate(pieces[0].shape)])
    for rank, piece in enumerate(pieces):
        for start, local, n in rank_pieces(sl, full_size, rank, world_size):
            out.narrow(sl.dim, start, n).copy_(piece.detach().narrow(sl.dim, local, n))
    return out


def merge_state_dicts(sharded: Any, states: list[dict], *, strict: bool = True) -> dict:
    """One state dict for the original model from the ranks' state dicts (rank order)."""
    ws = sharded.world_size
    if len(states) != ws:
        raise TPCompileError(f"merge_state_dicts needs {ws} state dicts (one per rank), got {len(states)}")
    merged: dict[str, torch.Tensor] = {}
    for name, full in sharded.captured.state_dict().items():
        missing = [r for r, s in enumerate(states) if name not in s]
        if missing:
            if strict:
                raise TPCompileError(f"state dict of rank {missing[0]} has no {name!r}; pass strict=False to skip it")
            continue
        sl: Optional[Any] = sharded.slice_for(name)
        merged[name] = merge_slices([s[name] for s in states], sl, full.shape[sl.dim] if sl else 0, ws)
    return merged
