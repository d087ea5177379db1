"""Scripts run under torchrun (the examples): a user error is one line from rank 0, not a traceback per rank."""
from __future__ import annotations

import os
import sys
from typing import Any, Callable

from tpcompile.cli.common import one_line
from tpcompile.errors import TPCompileError

EXIT_ERROR = 2  # as the tpcompile command: a user error


def launch_rank() -> int:
    """This process's rank: the process group's when one is running, else torchrun's RANK, else 0."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def run_script(main: Callable[[], Any]) -> int:
    """Run `main`; a TPCompileError becomes one 'error: ...' line on stderr from rank 0 and exit code 2.

    Every rank meets the same user error (the ranks agree on model, inputs and layout before they
    compute), so rank 0's line says it once; the other ranks exit with the same code, silently.
    """
    try:
        main()
    except TPCompileError as exc:
        if launch_rank() == 0:
            print(f"error: {one_line(str(exc))}", file=sys.stderr, flush=True)
        _leave_group()
        return EXIT_ERROR
    return 0


def _leave_group() -> None:
    """Destroy the default process group if this process still holds one, so that it exits without hanging."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001  leaving after an error: nothing more to report
            pass
