"""Periodic checkpoints in one directory: `step_000012/` per save, the newest complete one, pruning, resuming.

    start = tpcompile.dcp.resume(hm, "ckpt", optimizer=opt)     # 0 when "ckpt" holds no complete checkpoint
    for step in range(start, steps):
        ...                                                      # batch `step`, forward, backward, opt.step()
        if (step + 1) % 100 == 0:
            tpcompile.dcp.save_step(hm, "ckpt", step + 1, optimizer=opt, keep=3)

A checkpoint counts once its `.complete` marker exists (record.py); `latest` skips the others, so a
job killed during a save resumes from the one before.
"""
from __future__ import annotations

import os
import re
import shutil
from typing import Any, Optional

import torch
import torch.distributed as dist

from tpcompile.checkpoint.record import is_complete
from tpcompile.checkpoint.train_state import Path, load, save
from tpcompile.errors import TPCompileError

__all__ = ["latest", "prune", "resume", "save_step", "step_dir"]

_STEP = re.compile(r"step_(\d+)")


def step_dir(directory: Path, step: int) -> str:
    """The checkpoint directory of `step` under `directory`: directory/step_000012."""
    return os.path.join(str(directory), f"step_{int(step):06d}")


def _steps(directory: str) -> list[tuple[int, str]]:
    """(step, path) of every step_N directory under `directory`, oldest first."""
    if not os.path.isdir(directory):
        return []
    found = [(int(m.group(1)), os.path.join(directory, name)) for name in os.listdir(directory)
             if (m := _STEP.fullmatch(name)) and os.path.isdir(os.path.join(directory, name))]
    return sorted(found)


def latest(directory: Path) -> Optional[str]:
    """The newest complete checkpoint under `directory` (its step_N with the largest N), or None."""
    complete = [path for _, path in _steps(str(directory)) if is_complete(path)]
    return complete[-1] if complete else None


def _check_keep(keep: Any) -> None:
    """Raise unless `keep` is an int >= 1."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise TPCompileError(f"keep must be an int >= 1 (the checkpoints to keep), got {keep!r}")


def prune(directory: Path, keep: int) -> list[str]:
    """Delete all but the newest `keep` complete checkpoints under `directory` (and unfinished older ones); the deleted.

    An unfinished checkpoint newer than the newest complete one is left alone: a save may be writing it.
    """
    _check_keep(keep)
    steps = _steps(str(directory))
    kept = [step for step, path in steps if is_complete(path)][-keep:]
    if not kept:
        return []
    gone = [path for step, path in steps if step < kept[0] or (step < kept[-1] and step not in kept)]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


def save_step(model: Any, directory: Path, step: int, *, optimizer: Optional[torch.optim.Optimizer] = None,
              extra: Any = None, keep: Optional[int] = None, group: Any = None) -> str:
    """Save the training state after `step` optimizer steps to directory/step_N (every rank); its path.

    With `keep`, the first rank then deletes all but the newest `keep` complete checkpoints.
    """
    if keep is not None:
        _check_keep(keep)  # on every rank, before any of them saves
    path = step_dir(directory, step)
    save(model, path, optimizer=optimizer, step=step, extra=extra, group=group)
    first = not (dist.is_available() and dist.is_initialized()) or dist.get_rank(group) == 0
    if keep is not None and first:
        prune(directory, keep)
    return path


def resume(model: Any, directory: Path, *, optimizer: Optional[torch.optim.Optimizer] = None,
           group: Any = None) -> int:
    """Load the newest complete checkpoint under `directory` into the model (and optimizer); the step to start from.

    0 when there is none. Every rank loads the checkpoint the first rank found, at the layout it runs now.
    """
    path = latest(directory)
    if dist.is_available() and dist.is_initialized():  # one choice for all, whatever each rank's listing shows
        chosen = [path]
        dist.broadcast_object_list(chosen, src=dist.get_global_rank(group, 0) if group is not None else 0,
                                   group=group)
        path = chosen[0]
    if path is None:
        return 0
    step = load(model, path, optimizer=optimizer, group=group)["step"]
    return int(step) if step is not None else int(_STEP.fullmatch(os.path.basename(path)).group(1))
