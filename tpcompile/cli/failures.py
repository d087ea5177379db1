"""Failures in the user's terms: a model that fails on its inputs even unsharded, symbolic sizes made concrete,
hints that name the command line's flags, and a `tpcompile` folder that shadows the installed package."""
from __future__ import annotations

import re
from typing import Any, Optional

import torch

from tpcompile.capture.export import user_frame
from tpcompile.capture.input_dtypes import InputDtypeError
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
    """`text` without torch.export's symbols: lists show '?', a lone s<N> reads 'a dynamic size' and a lone u<N>
    (a value read from a tensor's contents) 'a data-dependent value'; what they stand for follows."""
    if not _SYMBOL.search(text):
        return text
    sized = bool(re.search(r"\bs\d+\b", text))
    valued = bool(re.search(r"\bu\d+\b", text))
    text = _SIZE_LIST.sub(_sizes, text)
    text = re.sub(r"\bu\d+\b", "a data-dependent value", text)
    text = _SYMBOL.sub("a dynamic size", text)
    notes = []
    if sized:
        notes.append(f"? and 'a dynamic size' stand for sizes of the inputs, which were {inputs}")
    if valued:
        notes.append("'a data-dependent value' is one the model reads from a tensor's contents (.item(), int(), "
                     "a comparison used in an if), which the capture cannot know")
    return f"{text} ({'; '.join(notes)})"


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


# failures of the code itself, whatever the inputs: the way out is in the code, not in --inputs
_CODE_ERRORS = (NameError, AttributeError, ImportError, SyntaxError, NotImplementedError, AssertionError)


def _way_out(own: BaseException, spec: str, from_flags: bool) -> str:
    """What to change when the unsharded model fails too: the code, the config, or the --inputs."""
    if isinstance(own, _CODE_ERRORS):
        return "the error is in the model's code, whatever its inputs: fix it there"
    given = "the --inputs given" if from_flags else "its own example inputs"
    if spec.startswith("hf:"):
        return (f"the model fails on {given}: check the --config sizes (hf: models are built with 2 layers, width "
                f"64 and 4 heads, a head dim of 16, and a size the config keeps at its default may not fit them)"
                + (", or the --inputs" if from_flags else ""))
    if from_flags:
        return "pass --inputs SHAPE[:DTYPE[:HIGH]] it accepts, one per positional argument of forward"
    return (f"the model fails on {given} (example_inputs()): fix them or the model, or pass --config arguments "
            f"for its class or --inputs SHAPE[:DTYPE[:HIGH]] it accepts")


def _cli_dtype_advice(exc: InputDtypeError) -> str:
    """The --inputs spec an InputDtypeError asks for, when it names a positional input."""
    if exc.position is None or not exc.shape:
        return ""
    dims = "x".join(map(str, exc.shape))
    suffix = {torch.float32: "", torch.float64: ":double", torch.float16: ":half", torch.bfloat16: ":bf16"}
    tail = suffix.get(exc.wanted, ":long" if not exc.wanted.is_floating_point else "")
    return f"{exc.what}; write --inputs {dims}{tail} for input {exc.position + 1}"


def explain_capture_failure(exc: TPCompileError, model: torch.nn.Module, name: str, args: tuple, kwargs: dict,
                            inputs: str, *, spec: str = "", from_flags: bool = True) -> TPCompileError:
    """A capture failure as the user can act on it: their model's own error on these inputs when it fails
    unsharded too (with the line of their code), else torch.export's message with concrete sizes and
    command-line hints. `from_flags`: the inputs came from --inputs, not from the model."""
    if isinstance(exc, InputDtypeError):
        advice = _cli_dtype_advice(exc)
        return TPCompileError(advice) if advice else exc
    text = str(exc)
    if not text.startswith(CAPTURE_FAILED):  # a pass's error may still name torch's size symbols
        plain = concrete_sizes(text, inputs)
        return exc if plain == text else TPCompileError(plain)
    own = eager_failure(model, args, kwargs)
    if own is not None:
        first = (str(own).strip().splitlines() or [""])[0]
        where = user_frame(own)
        return TPCompileError(f"{name} fails on its inputs ({inputs}) even unsharded: {type(own).__name__}: "
                              f"{first}{f' ({where})' if where else ''}; {_way_out(own, spec, from_flags)}")
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
