"""What the model subcommands share: MODEL, --world-size, --inputs, --config, loading and sharding."""
from __future__ import annotations

import argparse
import inspect
import io
import shutil
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stderr
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from torch import nn

from tpcompile.cli.failures import explain_capture_failure
from tpcompile.cli.inputs import (SPEC_HELP, check_specs, describe_inputs, inputs_from_specs, parse_input_spec,
                                  suggest_inputs)
from tpcompile.models.spec import ACCEPTED_FORMS, load_model
from tpcompile.cli.progress import note, step
from tpcompile.errors import TPCompileError
from tpcompile.report.wording import short_warning

CAPTURE_SEED = 0


def world_size(text: str) -> int:
    """argparse type for --world-size: an int of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def tolerance(text: str) -> float:
    """argparse type for --atol / --rtol: a finite number of at least 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (0.0 <= value < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number of at least 0, got {text}")
    return value


def config_value(text: str) -> Any:
    """A --config value: int, float, true/false, none, a comma list (a tuple), else the string."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    if "," in text:
        return tuple(config_value(t) for t in text.split(",") if t.strip())
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_config(items: list[str]) -> dict[str, Any]:
    """['n_layer=1', 'attention=manual'] -> {'n_layer': 1, 'attention': 'manual'}."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise TPCompileError(f"--config {item!r} is not key=value (e.g. --config n_layer=1)")
        out[key.strip()] = config_value(value.strip())
    return out


def add_model_args(p: argparse.ArgumentParser, *, default_model: str | None = None) -> None:
    """MODEL (optional when there is a default) and the flags every model subcommand takes."""
    if default_model is None:
        p.add_argument("model", metavar="MODEL", help=ACCEPTED_FORMS)
    else:
        p.add_argument("model", metavar="MODEL", nargs="?", default=default_model,
                       help=f"{ACCEPTED_FORMS} (default {default_model})")
    p.add_argument("-w", "--world-size", type=world_size, default=2, metavar="N", help="number of ranks (default 2)")
    p.add_argument("--inputs", action="append", default=[], metavar="SPEC",
                   help=f"one per positional input, in order: {SPEC_HELP} (default: the model's example inputs)")
    p.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                   help="override a size or switch of an hf: or bundled model, or pass an argument to a "
                        "class or factory (repeatable)")
    p.add_argument("--sequence-parallel", action="store_true", help="shard with sequence_parallel=True")
    p.add_argument("--plan", metavar="FILE", default=None,
                   help="a YAML plan file (module path -> replicate | sharded_output | auto)")


@dataclass
class Loaded:
    """A model, the example inputs it is captured with, and how to name it."""

    spec: str
    model: nn.Module
    args: tuple
    kwargs: dict

    @property
    def name(self) -> str:
        return f"{type(self.model).__name__} ({self.spec})"

    @property
    def inputs(self) -> str:
        return describe_inputs(self.args, self.kwargs)


def load(ns: argparse.Namespace) -> Loaded:
    """Resolve MODEL with --config, and the example inputs from --inputs or the model; refuse before any
    sharding when there are none, or when --inputs do not fit the model."""
    specs = [parse_input_spec(s) for s in ns.inputs]  # checked before the slow part
    config = parse_config(ns.config)
    with step(f"loading {ns.model}"):
        model, args, kwargs = load_model(ns.model, config)
    name = f"{type(model).__name__} ({ns.model})"
    if specs:
        check_specs(ns.inputs, specs, model, name, args, kwargs)
        args, kwargs = inputs_from_specs(specs, model, args, kwargs, CAPTURE_SEED)
    elif not args and not kwargs:
        raise TPCompileError(
            f"{ns.command} needs inputs and {ns.model} has no example_inputs(); pass --inputs SHAPE[:DTYPE] once "
            f"per positional argument of {type(model).__name__}.forward{_signature(model)}, e.g. "
            f"{suggest_inputs(model)}, or give the model an example_inputs() method")
    return Loaded(ns.model, model, args, kwargs)


def _signature(model: nn.Module) -> str:
    """forward's parameters as written, '(...)' when Python cannot tell."""
    try:
        return str(inspect.signature(model.forward))
    except (TypeError, ValueError):
        return "(...)"


def load_plan(ns: argparse.Namespace) -> Any:
    """The --plan file's overrides, or None."""
    if not getattr(ns, "plan", None):
        return None
    from tpcompile.overrides import load_overrides
    return load_overrides(ns.plan)


def shard(ns: argparse.Namespace, loaded: Loaded, *, show_warnings: bool = True) -> Any:
    """Capture and shard the model; each TPCompileWarning becomes one 'warning:' line on stderr (in full
    with --debug), unless the command lists them itself."""
    import tpcompile

    plan = load_plan(ns)
    with step(f"capturing {loaded.name} and sharding it across {ns.world_size} ranks"):
        with warnings.catch_warnings(record=True) as caught, quiet_stderr(not ns.debug):
            warnings.simplefilter("always", tpcompile.TPCompileWarning)
            try:
                sm = tpcompile.shard(loaded.model, ns.world_size, example_inputs=loaded.args,
                                     example_kwargs=loaded.kwargs, plan=plan,
                                     sequence_parallel=ns.sequence_parallel)
            except TPCompileError as exc:
                raise explain_capture_failure(exc, loaded.model, loaded.name, loaded.args, loaded.kwargs,
                                              loaded.inputs, spec=loaded.spec, from_flags=bool(ns.inputs)) from exc
    shown: set[str] = set()
    for w in caught:
        if not issubclass(w.category, tpcompile.TPCompileWarning):  # not ours: pass it on unchanged
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
        elif show_warnings and str(w.message) not in shown:
            shown.add(str(w.message))
            note(f"warning: {one_line(str(w.message)) if ns.debug else short_warning(str(w.message))}")
    return sm


@contextmanager
def quiet_stderr(enabled: bool) -> Iterator[None]:
    """Hold back what runs inside writes to stderr; pass it on only if the block succeeds.

    torch.export prints the partial graph of a model it cannot capture straight to stderr; the
    one-line error says what went wrong and --debug shows everything.
    """
    if not enabled:
        yield
        return
    held = io.StringIO()
    with redirect_stderr(held):
        yield
    sys.stderr.write(held.getvalue())


def one_line(text: str) -> str:
    """A possibly multi-line message on one line."""
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def stdout_console() -> Console:
    """A console for tables on stdout: the terminal's width, or at least 120 columns in a pipe or file."""
    if sys.stdout.isatty():
        return Console()
    return Console(file=sys.stdout, width=max(120, shutil.get_terminal_size((120, 24)).columns),
                   color_system=None, force_terminal=False)


def print_out(draw: Callable[[Console], None]) -> None:
    """Let draw print to stdout; in a pipe or file, without the padding spaces rich leaves at line ends."""
    console = stdout_console()
    if console.is_terminal:
        draw(console)
        return
    with console.capture() as captured:
        draw(console)
    sys.stdout.write("".join(line.rstrip() + "\n" for line in captured.get().splitlines()))
    sys.stdout.flush()
