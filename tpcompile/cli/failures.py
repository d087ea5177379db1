"""Failures in the user's terms: a model that fails on its inputs even unsharded, symbolic sizes made concrete,
hints that name the command line's flags, and a `tpcompile` folder that shadows the installed package."""
from __future__ import annotations

import re
from typing import Any, Optional

import torch

from tpcompile.errors import TPCompileError

CAPTURE_FAILED = "torch.export could not capture"
# torch.export names each dynamic size s<N> (u<N> when data-dependent); they mean nothing to the user
_SYMBOL = re.compile(r"\b[su]\d+\b")
_SIZE_LIST = re.compile(r"(?:torch\.Size\()?\[((?:\s*(?:[su]\d+|\d+)\s*,)*\s*(?:[su]\d+|\d+)\s*)\]\)?")
_API_HINT = re.compile(r"dynamic_shapes=\.\.\. to fix a dimension that cannot vary \(e\.g\. dynamic_shapes=\{.*?\}\)")


def _sizes(m: re.Match) -> str:
    """'[s77, s27, 64]' -> '[?, ?, 64]': a size list with its dynamic sizes marked."""
    if not _SYMBOL.search(m.group(1)):
        return m.group(0)
    return "[" + ", ".join("?" if _SYMBOL.fullmatch(x.strip()) else x.strip() for x in m.group(1).split(",")) + "]"


def concrete_sizes(text: str, inputs: str) -> str:
    """`text` without torch.export's size symbols: lists show '?', a lone symbol reads 'a dynamic size', and the
    sizes of the inputs it was given follow."""
    if not _SYMBOL.search(text):
        return text
    text = _SIZE_LIST.sub(_sizes, text)
    text = _SYMBOL.sub("a dynamic size", text)
    return f"{text} (? and 'a dynamic size' stand for sizes of the inputs, which were {inputs})"


def command_line_hint(text: str) -> str:
    """The capture hint in command-line terms: no dynamic_shapes= flag exists there."""
    text = text.replace("try: example inputs that take", "try: --inputs that take")
    return _API_HINT.sub("tpcompile.shard(..., dynamic_shapes=...) from Python to fix a dimension that cannot "
                         "vary (the command line captures every dimension as dynamic)", text)


def eager_failure(model: torch.nn.Module, args: tuple, kwargs: dict) -> Optional[BaseException]:
    """The exception the unsharded model raises on these inputs, or None when it runs."""
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001  any failure of the user's own forward is the answer
        return exc
    return None


def explain_capture_failure(exc: TPCompileError, model: torch.nn.Module, name: str, args: tuple, kwargs: dict,
                            inputs: str) -> TPCompileError:
    """A capture failure as the user can act on it: their model's own error on these inputs when it fails
    unsharded too, else torch.export's message with concrete sizes and command-line hints."""
    text = str(exc)
    if not text.startswith(CAPTURE_FAILED):  # a pass's error may still name torch's size symbols
        plain = concrete_sizes(text, inputs)
        return exc if plain == text else TPCompileError(plain)
    own = eager_failure(model, args, kwargs)
    if own is not None:
        first = (str(own).strip().splitlines() or [""])[0]
        return TPCompileError(f"{name} fails on its inputs ({inputs}) even unsharded: {type(own).__name__}: "
                              f"{first}; pass inputs it accepts with --inputs SHAPE[:DTYPE[:HIGH]], one per "
                              "positional argument of forward")
    return TPCompileError(command_line_hint(concrete_sizes(text, inputs)))


def shadowing_folder() -> Optional[str]:
    """The folder that `import tpcompile` found instead of the package, when that is what happened.

    A folder named tpcompile without an __init__.py (typically the clone itself, seen from the
    folder that contains it) imports as an empty namespace package ahead of an editable install.
    """
    import tpcompile

    if getattr(tpcompile, "__file__", None) is not None:
        return None
    paths: Any = getattr(tpcompile, "__path__", [])
    return ", ".join(str(p) for p in paths) or "a folder named tpcompile"


def shadowing_message(folder: str) -> str:
    """What happened and the way out, in one line."""
    return (f"error: `import tpcompile` found the folder {folder} (no __init__.py: a namespace package) instead "
            "of the installed package, because the working directory holds a folder named tpcompile (the clone?); "
            "run from another folder, e.g. inside the clone, or rename that folder")
