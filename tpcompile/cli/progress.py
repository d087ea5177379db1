"""Progress on stderr: a rich spinner per long step when stderr is a terminal, nothing otherwise."""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator

from rich.console import Console

# Bound to the stderr of the start, so that hiding torch's prints (common.quiet_stderr) never hides this.
_console = Console(file=sys.stderr)


def interactive() -> bool:
    """True when stderr is a terminal, so a spinner cannot end up in a file or a pipe."""
    return _console.is_terminal and sys.stderr.isatty()


@contextmanager
def step(text: str) -> Iterator[None]:
    """Show `text` with a spinner while the block runs, then a check mark line."""
    if not interactive():
        yield
        return
    with _console.status(text):
        yield
    _console.print(f"[green]\u2713[/green] {text}", highlight=False)


def note(text: str) -> None:
    """One line on stderr (warnings), whether or not it is a terminal."""
    print(text, file=sys.stderr, flush=True)
