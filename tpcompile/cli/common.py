"""What the model subcommands share: MODEL, --world-size, --inputs, --config, loading and sharding."""
from __future__ import annotations

import argparse
import io
import math
import shutil
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, redirect_stderr
from dataclasses import dataclass
from typing import Any

import torch
from rich.console import Console
from torch import nn

from tpcompile.cli.inputs import SPEC_HELP, describe_inputs, inputs_from_specs, parse_input_spec
from tpcompile.cli.model_spec import ACCEPTED_FORMS, load_model
from tpcompile.cli.progress import note, step
from tpcompile.errors import TPCompileError

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


def add_model_args(p: argparse.ArgumentParser) -> None:
    """MODEL and the flags every model subcommand takes."""
    p.add_argument("model", metavar="MODEL", help=ACCEPTED_FORMS)
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
    """Resolve MODEL with --config, and the example inputs from --inputs or the model."""
    specs = [parse_input_spec(s) for s in ns.inputs]  # checked before the slow part
    config = parse_config(ns.config)
    with step(f"loading {ns.model}"):
        model, args, kwargs = load_model(ns.model, config)
    if specs:
        args, kwargs = inputs_from_specs(specs, model, args, kwargs, CAPTURE_SEED)
    return Loaded(ns.model, model, args, kwargs)


def shard(ns: argparse.Namespace, loaded: Loaded) -> Any:
    """Capture and shard the model; each TPCompileWarning becomes one 'warning:' line on stderr."""
    import tpcompile

    plan = None
    if getattr(ns, "plan", None):
        from tpcompile.overrides import load_overrides
        plan = load_overrides(ns.plan)
    with step(f"capturing {loaded.name} and sharding it across {ns.world_size} ranks"):
        with warnings.catch_warnings(record=True) as caught, quiet_stderr(not ns.debug):
            warnings.simplefilter("always", tpcompile.TPCompileWarning)
            sm = tpcompile.shard(loaded.model, ns.world_size, example_inputs=loaded.args,
                                 example_kwargs=loaded.kwargs, plan=plan,
                                 sequence_parallel=ns.sequence_parallel)
    for w in caught:
        if issubclass(w.category, tpcompile.TPCompileWarning):
            note(f"warning: {one_line(str(w.message))}")
        else:  # not ours: pass it on unchanged
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
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


def leaves(value: Any, path: str = "output") -> list[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor in a nest of tuples, lists and mappings (model output classes too)."""
    if isinstance(value, torch.Tensor):
        return [(path, value)]
    if isinstance(value, Mapping):
        return [x for k, v in value.items() for x in leaves(v, f"{path}.{k}" if path != "output" else str(k))]
    if isinstance(value, (tuple, list)):
        return [x for i, v in enumerate(value) for x in leaves(v, f"{path}[{i}]")]
    return []


def max_abs_diff(expected: Any, actual: Any) -> float:
    """Largest absolute elementwise difference over all tensors of two output structures."""
    exp, act = [t for _, t in leaves(expected)], [t for _, t in leaves(actual)]
    if len(exp) != len(act) or any(e.shape != a.shape for e, a in zip(exp, act)):
        return math.inf
    return max((float((e.detach().float() - a.detach().float()).abs().max()) for e, a in zip(exp, act)
                if e.numel()), default=0.0)


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
