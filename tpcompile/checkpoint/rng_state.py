"""Random-number state in a checkpoint: torch's generators per rank as tensors, tpcompile's dropout state as JSON.

torch's global CPU generator (and CUDA's current device's, where CUDA is initialised) is saved by
every rank: `rng.torch` is a (world size, state bytes) uint8 tensor whose row r rank r writes. A
load at the saved world size gives every rank its own row back, so a relaunch after a crash draws
what the uninterrupted run would have drawn. At another world size the ranks' streams cannot map
one to one (rank 3 of 4 has no counterpart among 2), so every rank takes rank 0's row: the state a
script that seeds torch alike on every rank (as examples/train_hybrid.py does) has on all of them.
tpcompile's dropout masks do not come from torch's generator: their state (tpcompile.ops.rng.state(),
plain ints, independent of the layout) goes to the JSON record from the first rank.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from tpcompile.checkpoint.dcp_checks import RNG_PREFIX, Want

__all__ = ["dropout_state", "load_targets", "restore_dropout", "rng_values"]

Values = Callable[[tuple[int, ...], list[tuple[tuple[int, ...], torch.Tensor]]], Any]


def _generators() -> dict[str, Callable[[], torch.Tensor]]:
    """The generators whose states a checkpoint holds: torch's CPU one, and CUDA's when it is in use."""
    out = {"torch": torch.get_rng_state}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state
    return out


def _setters() -> dict[str, Callable[[torch.Tensor], None]]:
    """The generators a checkpoint's states can be set into here."""
    out = {"torch": torch.set_rng_state}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.set_rng_state
    return out


def rng_values(rank: int, world: int, values: Values) -> dict[str, Any]:
    """This rank's row of each generator's (world, bytes) state tensor, as DCP values."""
    out = {}
    for name, get in _generators().items():
        state = get().reshape(1, -1)
        out[RNG_PREFIX + name] = values((world, state.shape[1]), [((rank, 0), state)])
    return out


def load_targets(md: Metadata, rank: int, world: int,
                 values: Values) -> tuple[dict[str, tuple[Any, Want]], Callable[[], None]]:
    """The rows this rank reads back ({key: (DCP value, Want)}) and the function that sets the generators."""
    wanted: dict[str, tuple[Any, Want]] = {}
    rows: dict[str, torch.Tensor] = {}
    setters = _setters()
    for name in setters:
        entry = md.state_dict_metadata.get(RNG_PREFIX + name)
        if not isinstance(entry, TensorStorageMetadata) or len(entry.size) != 2:
            continue
        saved_world, width = entry.size
        row = rank if saved_world == world else 0  # another world size: every rank takes rank 0's stream
        target = torch.empty((1, width), dtype=entry.properties.dtype)
        wanted[RNG_PREFIX + name] = (values(tuple(entry.size), [((row, 0), target)]),
                                     Want(tuple(entry.size), entry.properties.dtype))
        rows[name] = target

    def restore() -> None:
        """Set each generator from the row read for this rank."""
        for name, target in rows.items():
            setters[name](target.reshape(-1))
    return wanted, restore


def dropout_state() -> Optional[dict[str, Any]]:
    """tpcompile's dropout RNG state (plain ints), when this tpcompile has one to give."""
    from tpcompile.ops import rng
    state = getattr(rng, "state", None)
    return state() if callable(state) else None


def restore_dropout(state: Optional[dict[str, Any]]) -> None:
    """Set tpcompile's dropout RNG state saved by dropout_state()."""
    from tpcompile.ops import rng
    load = getattr(rng, "load_state", None)
    if state is not None and callable(load):
        load(state)
