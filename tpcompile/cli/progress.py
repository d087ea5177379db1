"""Progress on stderr: a rich spinner per long step when stderr is a terminal, plain lines otherwise.

In a pipe or a file a step that is still running after PLAIN_AFTER_S says so in one line, and one more
line gives its time when it ends; quicker steps print nothing, so a command that fails at once still
prints only its error. TPCOMPILE_PROGRESS=0 turns progress off (warnings and errors still print).
"""
from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator, TextIO

from rich.console import Console

# Bound to the stderr of the start, so that hiding torch's prints (common.quiet_stderr) never hides this.
_console = Console(file=sys.stderr)
PLAIN_AFTER_S = 1.0  # a step quicker than this leaves no line in a pipe or file
PREFIX = "tpcompile: "  # marks progress lines apart from warning: and error: lines


def enabled() -> bool:
    """False when TPCOMPILE_PROGRESS=0 asks for no progress at all."""
    return os.environ.get("TPCOMPILE_PROGRESS", "1").strip().lower() not in ("0", "false", "no", "off")


def interactive() -> bool:
    """True when stderr is a terminal, so a spinner cannot end up in a file or a pipe."""
    return _console.is_terminal and sys.stderr.isatty()


@contextmanager
def step(text: str) -> Iterator[None]:
    """Show `text` with a spinner while the block runs, then a check mark line; in a pipe, plain lines."""
    if not enabled():
        yield
        return
    if not interactive():
        with _plain(text, sys.stderr):
            yield
        return
    with _console.status(text):
        yield
    _console.print(f"[green]\u2713[/green] {text}", highlight=False)


@contextmanager
def _plain(text: str, stream: TextIO) -> Iterator[None]:
    """'tpcompile: TEXT ...' once the block has run PLAIN_AFTER_S, and 'tpcompile: TEXT: done in 12.3 s' after it."""
    start = time.perf_counter()
    said = threading.Event()

    def announce() -> None:
        """The first line, from the timer's thread."""
        said.set()
        _write(stream, f"{PREFIX}{text} ...")

    timer = threading.Timer(PLAIN_AFTER_S, announce)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()
    if said.is_set():
        _write(stream, f"{PREFIX}{text}: done in {time.perf_counter() - start:.1f} s")


def _write(stream: TextIO, line: str) -> None:
    """One line on `stream`, flushed at once (the stream may be gone by the time a late line comes)."""
    try:
        stream.write(line + "\n")
        stream.flush()
    except (ValueError, OSError):
        pass


def note(text: str) -> None:
    """One line on stderr (warnings), whether or not it is a terminal."""
    print(text, file=sys.stderr, flush=True)
