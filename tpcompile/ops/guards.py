"""Run-time checks inside rank graphs: inputs the capture assumed, token ids inside the vocabulary.

`InputGuard` is called first by every rank graph (and by the captured graph): it compares the
call's autocast state with the one the model was captured under, and each input dim the
capture fixed with the size it was fixed at, raising a TPCompileError that names the input,
the dim, the sizes and the way out. `ExportGuards` wraps torch.export's own guard module so
its failures read as TPCompileErrors too. Both raise `InputShapeError` for a shape the capture did not
take (before any collective runs), which the entry points that re-shard per shape catch
(runtime/shape_cache.py). `check_token_ids` is the vocabulary-parallel
embedding's check (the original's lookup raises on such ids; each rank holds only a slice of
the rows, so without it an id past the vocabulary would read as a zero row): a TPCompileError on
CPU, `torch._assert_async` on other devices and inside torch.compile (no host sync, no
data-dependent branch; the error is then torch's RuntimeError).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from tpcompile.errors import TPCompileError

AUTOCAST_DEVICES = ("cpu", "cuda")


def autocast_state() -> tuple[tuple[str, torch.dtype], ...]:
    """(device type, dtype) of each device type autocast is enabled for on this thread."""
    return tuple((d, torch.get_autocast_dtype(d)) for d in AUTOCAST_DEVICES if torch.is_autocast_enabled(d))


def describe_autocast(state: tuple) -> str:
    if not state:
        return "without torch.autocast"
    return "under " + " and ".join(f"torch.autocast({d!r}, dtype={dt})" for d, dt in state)


@dataclass(frozen=True)
class FixedDim:
    """An input dim the capture fixed: calls must give it exactly `size`."""

    input: str  # the input's name, e.g. 'input_ids'
    index: int  # position among the graph's inputs
    dim: int
    size: int
    cause: str


class InputShapeError(TPCompileError):
    """The inputs' shapes break a condition the capture assumed (a fixed dim, one of torch.export's guards).

    Raised by a rank graph's guards before it computes, so nothing ran; a capture at these shapes may take them.
    """


class InputGuard(nn.Module):
    """Checks each call against what the capture assumed (autocast state, fixed input dims)."""

    def __init__(self, fixed: tuple[FixedDim, ...], autocast: tuple) -> None:
        super().__init__()
        self.fixed, self.autocast = tuple(fixed), tuple(autocast)

    def forward(self, *inputs: Any) -> None:
        now = autocast_state()
        if now != self.autocast:
            raise TPCompileError(
                f"the model was captured {describe_autocast(self.autocast)} and is now called "
                f"{describe_autocast(now)}: autocast does not reach into a captured graph the way it reaches into "
                f"the model's own code (its dtype choices were fixed at capture), so the ranks would not compute "
                f"what the original computes. Shard in the same autocast context the model runs in "
                f"(`with torch.autocast(...): sm = tpcompile.shard(model, ...)`) and call the ranks in it")
        for f in self.fixed:
            x = inputs[f.index] if f.index < len(inputs) else None
            if isinstance(x, torch.Tensor) and f.dim < x.dim() and _concrete(x.shape[f.dim]) not in (None, f.size):
                raise InputShapeError(
                    f"input {f.input!r} has size {int(x.shape[f.dim])} in dim {f.dim}, but the capture fixed that dim "
                    f"at {f.size} ({f.cause}); shard with example inputs whose dim {f.dim} of {f.input!r} is the size "
                    f"you run with, or a size of 2 or more so that it stays dynamic; or call the ranks through "
                    f"tpcompile.simulate, tpcompile.parallelize or sm.shapes.sharded_for(*inputs), which capture "
                    f"again for a new size")


def _concrete(size: Any) -> Optional[int]:
    """An int size, or None for a symbolic one (fake-tensor runs check nothing)."""
    return size if isinstance(size, int) else None


class ExportGuards(nn.Module):
    """torch.export's guard module, with its failures raised as TPCompileErrors."""

    def __init__(self, guards: nn.Module) -> None:
        super().__init__()
        self.guards = guards

    def forward(self, *inputs: Any) -> Any:
        try:
            return self.guards(*inputs)
        except AssertionError as e:
            raise InputShapeError(
                f"the inputs break a condition the capture assumed ({e}); shard with example inputs shaped like "
                f"the ones you run with (sizes of 2 or more stay dynamic), or call the ranks through "
                f"tpcompile.simulate, tpcompile.parallelize or sm.shapes.sharded_for(*inputs), which capture again "
                f"for a new shape") from e


def check_token_ids(ids: torch.Tensor, vocab: int, where: str) -> torch.Tensor:
    """`ids` itself, after checking every id lies in [0, vocab) as the unsharded lookup requires."""
    if ids.numel() == 0 or ids.device.type == "meta" or isinstance(ids, torch._subclasses.FakeTensor):
        return ids
    if ids.is_floating_point():  # the unsharded lookup refuses floats; their values would read as ids here
        raise TPCompileError(f"token ids at {where} are {str(ids.dtype).removeprefix('torch.')}; the model takes "
                             f"integer ids 0..{vocab - 1}: pass a torch.long tensor")
    if ids.device.type != "cpu" or torch.compiler.is_compiling():  # no host sync, no data-dependent branch
        torch._assert_async(((ids >= 0) & (ids < vocab)).all(), f"token id outside the vocabulary of {vocab} at {where}")
        return ids
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab:
        bad = low if low < 0 else high
        raise TPCompileError(f"token id {bad} at {where} is outside the vocabulary of {vocab} ids (0 to {vocab - 1}); "
                             f"the unsharded model raises on it too: pass ids 0..{vocab - 1}")
    return ids
