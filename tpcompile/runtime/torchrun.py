"""Joining a torchrun launch: the process group from torchrun's environment, with a bounded timeout; leaving it."""
from __future__ import annotations

import gc
import os
from datetime import timedelta

import torch
import torch.distributed as dist
# Imported before any group exists, on purpose: its functions' `group=group.WORLD` defaults are
# evaluated at import. Imported after init_process_group (torch.export pulls it in while tpcompile
# captures), they hold the WORLD group for good, so destroy_process_group cannot free it and gloo's
# worker threads live on into interpreter shutdown. There, a worker that drops the last reference to
# a finished work (which holds the collective's tensors) needs the GIL, is ended by the finalizing
# interpreter inside a C++ destructor, and std::terminate aborts the process after its work is done.
import torch.distributed.nn.functional  # noqa: F401

from tpcompile.errors import TPCompileError
from tpcompile.runtime.backends import forget_process_groups
from tpcompile.runtime.failures import translate
from tpcompile.runtime.launch import free_port
from tpcompile.runtime.restart_store import restart_store

__all__ = ["DEFAULT_TIMEOUT_S", "collective_timeout", "init_from_env", "shutdown"]

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
        store = restart_store(collective_timeout())
        if store is not None:  # under torchrun: a key space per restart attempt (runtime/restart_store.py)
            dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), timeout=collective_timeout())
        else:
            dist.init_process_group(backend, init_method="env://", timeout=collective_timeout())
    return dist.get_rank(), dist.get_world_size()


def shutdown(*, destroy: bool = True) -> None:
    """Leave the process group: a barrier (no rank tears down while a peer is still in a collective), then destroy it.

    Call it at the end of a script, on every rank. With `destroy=False` (the group belongs to a
    caller, as when tests run a script inside their own launch) only the barrier runs. After
    destroying, the group's gloo or NCCL threads have ended once nothing else holds the group, so
    the interpreter exits without them. A peer that died before the barrier raises a TPCompileError
    (tpcompile.runtime.failures) after this process's side of the group is destroyed anyway.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.barrier()
    except RuntimeError as e:
        error = translate(e, where="the final barrier of tpcompile.runtime.shutdown()")  # while the group is known
        if destroy:
            _destroy()
        raise error from e
    if destroy:
        _destroy()


def _destroy() -> None:
    """Destroy every process group and drop tpcompile's references to them, so their threads end now."""
    dist.destroy_process_group()
    forget_process_groups()
    gc.collect()  # a group caught in a reference cycle is freed here, not during interpreter shutdown
