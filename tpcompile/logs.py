"""The "tpcompile" logger: every record carries the rank that wrote it; TPCOMPILE_LOG and `-v` show the lines.

A filter on the logger sets `record.rank` (this process's rank in the default process group, else
torchrun's RANK, else "-") and `record.world` on every record, so a handler's format can say
`%(rank)s`. TPCOMPILE_LOG=info (or debug, warning, error, or a number) adds one stderr handler
with the format FORMAT at that level, in this process and, being an environment variable, in
every rank process it starts; `tpcompile -v` (info) and `-vv` (debug) do the same for one command.
"""
from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Callable
from typing import Optional

__all__ = ["FORMAT", "LOGGER", "RankFilter", "current_rank", "parse_level", "show", "verbose"]

LOGGER = "tpcompile"
ENV = "TPCOMPILE_LOG"
FORMAT = "[rank %(rank)s] %(levelname)s %(name)s: %(message)s"
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
          "critical": logging.CRITICAL}


def current_rank() -> tuple[str, str]:
    """(rank, world size) of this process as text: the process group's, else torchrun's variables, else '-'."""
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return str(dist.get_rank()), str(dist.get_world_size())
    except (ImportError, RuntimeError):
        pass
    return os.environ.get("RANK", "-"), os.environ.get("WORLD_SIZE", "-")


class RankFilter(logging.Filter):
    """Adds `rank` and `world` to every record (it never drops one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Set the record's rank and world size; keep it."""
        record.rank, record.world = current_rank()
        return True


def parse_level(text: str) -> Optional[int]:
    """A logging level from 'info', 'DEBUG', '20' ...; None for text that names none."""
    value = text.strip().lower()
    if value.isdigit():
        return int(value)
    return LEVELS.get(value)


class _Handler(logging.StreamHandler):
    """tpcompile's own stderr handler (one at most), told apart from the user's."""


def show(level: int) -> logging.Handler:
    """Print the tpcompile logger's records at `level` and above on stderr, each with its rank."""
    logger = logging.getLogger(LOGGER)
    handler = next((h for h in logger.handlers if isinstance(h, _Handler)), None)
    if handler is None:
        handler = _Handler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT))
        handler.addFilter(RankFilter())  # records of child loggers reach it too
        logger.addHandler(handler)
    handler.setLevel(level)
    logger.setLevel(level)
    return handler


def verbose(count: int) -> Callable[[], None]:
    """The CLI's -v (info) / -vv (debug): tpcompile's lines shown, other libraries' held back; the undo."""
    level = logging.INFO if count == 1 else logging.DEBUG
    previous = os.environ.get(ENV)
    os.environ[ENV] = logging.getLevelName(level).lower()  # rank processes started meanwhile show them too
    logger = logging.getLogger(LOGGER)
    old_level = logger.level
    handler = show(level)
    root = logging.getLogger()
    silent = logging.NullHandler()  # torch's own warnings would reach Python's last-resort handler
    root.addHandler(silent)

    def undo() -> None:
        """Remove what verbose() added and restore the variable."""
        root.removeHandler(silent)
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        if previous is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = previous

    return undo


def _install() -> None:
    """At import: the rank filter on the logger, and TPCOMPILE_LOG's handler when it is set."""
    logger = logging.getLogger(LOGGER)
    if not any(isinstance(f, RankFilter) for f in logger.filters):
        logger.addFilter(RankFilter())
    text = os.environ.get(ENV, "").strip()
    if not text:
        return
    level = parse_level(text)
    if level is None:
        from tpcompile.errors import TPCompileWarning
        warnings.warn(f"{ENV}={text!r} names no logging level; use one of {', '.join(LEVELS)} (or a number); "
                      f"tpcompile logs as if it were unset", TPCompileWarning, stacklevel=2)
        return
    show(level)


_install()
