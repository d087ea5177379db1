"""Weight files opened with errors that name the file: .safetensors headers and slices, torch.save'd state dicts."""
from __future__ import annotations

import json
import os
import struct
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from tpcompile.errors import TPCompileError

__all__ = ["load_state_file", "safetensors_index", "safetensors_open"]

_DAMAGED = ("the file is damaged (cut short by an interrupted copy or save, or not a safetensors file); "
            "copy or save it again")


@contextmanager
def safetensors_open(path: Path, tensor: str = "") -> Iterator[Any]:
    """safe_open(path) whose failures, on opening or reading, are TPCompileErrors naming the file (and tensor)."""
    from safetensors import SafetensorError, safe_open
    what = f"weights file {str(path)!r}" + (f", tensor {tensor!r}" if tensor else "")
    try:
        with safe_open(str(path), framework="pt") as handle:
            yield handle
    except SafetensorError as e:
        cut = "" if tensor else _cut_tensor(path)
        raise TPCompileError(f"{what}: safetensors cannot read it ({e}){cut}; {_DAMAGED}") from e
    except OSError as e:  # the file vanished or cannot be mapped
        raise TPCompileError(f"{what}: cannot be read ({e})") from e


def _cut_tensor(path: Path) -> str:
    """', tensor X ... lies past its end' when the file's own header says a tensor is cut off, else ''."""
    try:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n)) if n < 100_000_000 else None
        size = os.path.getsize(path)
    except (OSError, ValueError, struct.error):  # no readable header: nothing more to say
        return ""
    if not isinstance(header, dict):
        return ""
    start, cut = 8 + n, []
    for name, entry in header.items():
        ends = entry.get("data_offsets") if isinstance(entry, dict) else None
        if isinstance(ends, list) and len(ends) == 2 and start + int(ends[1]) > size:
            cut.append((int(ends[0]), int(ends[1]), name))
    if not cut:
        return ""
    _, end, name = min(cut)  # the first tensor the cut reaches
    return f"; tensor {name!r} is stored up to byte {start + end} but the file has {size} bytes (truncated)"


def safetensors_index(path: Path) -> list[str]:
    """The tensor names in a .safetensors file; its header and size are checked by safetensors on opening."""
    with safetensors_open(path) as handle:
        return list(handle.keys())


def load_state_file(path: Path) -> dict[str, torch.Tensor]:
    """A torch.save'd state dict, read with weights_only (no code runs) and mmap (pages read on demand)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise _unreadable(path, e) from e
        # files of the legacy (pre-1.6, not zip) format cannot be mapped; read them whole
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as inner:  # noqa: BLE001  torch.load raises many types for one cause
            raise _unreadable(path, inner) from inner
    except Exception as e:  # noqa: BLE001  (pickle, EOF, zip errors: all mean the file cannot be used)
        raise _unreadable(path, e) from e
    if not isinstance(state, dict):
        raise TPCompileError(f"weights file {str(path)!r} holds a {type(state).__name__}, not a state dict; "
                             f"save one with torch.save(model.state_dict(), path)")
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            hint = (f"pass torch.load(path)[{key!r}] as weights, or " if isinstance(value, dict) else "")
            raise TPCompileError(f"weights file {str(path)!r} is not a state dict: entry {key!r} is not a "
                                 f"tensor but {type(value).__name__}; {hint}save "
                                 f"torch.save(model.state_dict(), path)")
    return state


def _unreadable(path: Path, e: BaseException) -> TPCompileError:
    """The error for a torch.save file that torch.load refuses (damaged, or pickling more than tensors)."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if "weights only load failed" in str(e).lower() or "weights_only" in str(e):
        why = ("it pickles objects other than tensors, which tpcompile does not unpickle (they could run "
               "code); save torch.save(model.state_dict(), path)")
    else:
        why = "the file is damaged or not a torch.save file; save it again"
    return TPCompileError(f"weights file {str(path)!r} cannot be loaded ({type(e).__name__}: {first}); {why}")
