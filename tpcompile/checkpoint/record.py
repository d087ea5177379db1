"""A checkpoint's JSON record (step, user data, optimizer hyperparameters, RNG seeds) and its completion marker.

Only tensors go through torch.distributed.checkpoint; everything else a training checkpoint holds is
plain JSON in `tpcompile.json`, written by the first rank before any tensor, so nothing is pickled
(DCP's pickled entries run code when they are loaded). The marker `.complete` is written last, after
every rank's files: a directory with the record and without the marker is a save that did not finish
(a rank died, or the job was killed while writing), which `load` refuses and `latest` skips. A DCP
directory with neither is a checkpoint of the weights alone (stock torch.distributed.checkpoint, or an
older tpcompile).
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional

from tpcompile.errors import TPCompileError

__all__ = ["FORMAT", "MARKER", "RECORD", "check_json", "is_complete", "mark_complete", "read_record", "start_record"]

RECORD = "tpcompile.json"
MARKER = ".complete"
FORMAT = 1  # the record's layout; a later tpcompile reading an older one converts it


def check_json(value: Any, where: str) -> None:
    """Raise a TPCompileError naming the first part of `value` that JSON cannot hold exactly."""
    bad = _first_unjsonable(value, where)
    if bad:
        raise TPCompileError(f"{bad}; extra= must be JSON data (dicts with str keys, lists, str, int, float, bool, "
                             f"None; a tuple comes back as a list): it is written as JSON, never pickled. Convert a "
                             f"tensor with .tolist(), another object to its state in plain values")


def _first_unjsonable(value: Any, where: str) -> str:
    """'' when JSON holds `value` (tuples come back as lists), else what and where the first obstacle is."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return ""
    if isinstance(value, (list, tuple)):
        return next((b for i, v in enumerate(value) if (b := _first_unjsonable(v, f"{where}[{i}]"))), "")
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                return f"{where} has the key {k!r} ({type(k).__name__}); JSON keys are strings"
            bad = _first_unjsonable(v, f"{where}[{k!r}]")
            if bad:
                return bad
        return ""
    return f"{where} is a {type(value).__module__}.{type(value).__qualname__} ({_short(value)})"


def _short(value: Any) -> str:
    """A value's repr, cut to one short line."""
    text = repr(value).splitlines()[0] if repr(value) else type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def start_record(path: str, record: dict[str, Any]) -> None:
    """Begin a save at `path`: drop an earlier marker, then write the record (atomically) before any tensor."""
    os.makedirs(path, exist_ok=True)
    marker = os.path.join(path, MARKER)
    if os.path.exists(marker):  # saving over a checkpoint: it is incomplete until this save's marker
        os.remove(marker)
    tmp = os.path.join(path, RECORD + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"format": FORMAT, **record}, f)
    os.replace(tmp, os.path.join(path, RECORD))


def mark_complete(path: str) -> None:
    """Write the marker that makes `path` a complete checkpoint (after every rank's files)."""
    tmp = os.path.join(path, MARKER + ".tmp")
    with open(tmp, "w") as f:
        f.write("complete\n")
    os.replace(tmp, os.path.join(path, MARKER))


def is_complete(path: str) -> bool:
    """True when `path` holds a finished tpcompile checkpoint (the record and the marker)."""
    return os.path.isfile(os.path.join(path, MARKER)) and os.path.isfile(os.path.join(path, RECORD))


def read_record(path: str) -> Optional[dict[str, Any]]:
    """The record of a complete checkpoint; None for weights alone (no record); raises for an unfinished save."""
    file = os.path.join(path, RECORD)
    if not os.path.isfile(file):
        return None
    if not os.path.isfile(os.path.join(path, MARKER)):
        raise TPCompileError(f"checkpoint {path!r} is incomplete: it has {RECORD} but no {MARKER} marker, which "
                             f"tpcompile.dcp.save writes last, after every rank's files; its save did not finish (a "
                             f"rank died or the job was stopped while writing). Load an earlier checkpoint: "
                             f"tpcompile.dcp.latest(directory) returns the newest complete one")
    try:
        with open(file) as f:
            record = json.load(f)
    except (OSError, ValueError) as e:
        raise TPCompileError(f"checkpoint record {file!r} cannot be read ({type(e).__name__}: {e}); the file is "
                             f"damaged: save the checkpoint again or load an earlier one") from e
    if not isinstance(record, dict) or not isinstance(record.get("format"), int):
        raise TPCompileError(f"checkpoint record {file!r} is not a tpcompile record (no 'format'); save the "
                             f"checkpoint again with tpcompile.dcp.save")
    if record["format"] > FORMAT:
        raise TPCompileError(f"checkpoint record {file!r} has format {record['format']}, newer than this tpcompile "
                             f"reads ({FORMAT}); load it with the tpcompile that saved it, or upgrade")
    return record
