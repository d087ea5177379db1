"""Joining a torchrun launch: the process group from torchrun's environment, with a bounded timeout."""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from tpcompile.errors import TPCompileError
from tpcompile.runtime.launch import free_port

__all__ = ["DEFAULT_TIMEOUT_S", "collective_timeout", "init_from_env"]

# Seconds a collective (and the rendezvous) may wait before the group gives up, unless
# TPCOMPILE_TIMEOUT_S says otherwise: a rank that died or diverged then fails the others
# with an error instead of leaving them blocked for torch's default of 10-30 minutes.
DEFAULT_TIMEOUT_S = 300.0


def collective_timeout() -> timedelta:
    """The process-group timeout: $TPCOMPILE_TIMEOUT_S seconds, default DEFAULT_TIMEOUT_S."""
    raw = os.environ.get("TPCOMPILE_TIMEOUT_S", "")
    try:
        seconds = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise TPCompileError(f"TPCOMPILE_TIMEOUT_S={raw!r} is not a positive number of seconds")
    return timedelta(seconds=seconds)


def init_from_env(backend: str | None = None, *, standalone: bool = False) -> tuple[int, int]:
    """Initialise torch.distributed from torchrun's environment if needed; (rank, world_size).

    The backend is NCCL (device cuda:LOCAL_RANK) when CUDA is available, else gloo; the
    group's timeout comes from collective_timeout(). With `standalone`, a process started
    without torchrun becomes a one-rank group on a free local port instead of an error.
    """
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
                   if k not in os.environ]
        if missing and standalone and len(missing) == 4:
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(free_port()))
        elif missing:
            raise TPCompileError(f"environment lacks {', '.join(missing)}: start this script "
                                 f"with torchrun, or call torch.distributed.init_process_group")
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, init_method="env://", timeout=collective_timeout())
    return dist.get_rank(), dist.get_world_size()
