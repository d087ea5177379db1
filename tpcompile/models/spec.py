"""Turn a MODEL string from the command line into a module and its example inputs."""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import importlib.util
import os
import sys
import zlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tpcompile.errors import TPCompileError
from tpcompile.models import MODEL_NAMES, build
from tpcompile.models.hf import load_hf

ACCEPTED_FORMS = (
    "file.py:NAME, pkg.mod:NAME (NAME an nn.Module instance, or an nn.Module subclass or factory, called with "
    f"the --config arguments), a bundled model ({', '.join(MODEL_NAMES)}) or hf:<model_type> (e.g. hf:gpt2, hf:llama)"
)

def load_model(spec: str, config: dict[str, Any] | None = None) -> tuple[nn.Module, tuple, dict]:
    """Resolve `spec` to (module, example args, example kwargs); `config` overrides sizes and switches."""
    spec = spec.strip()
    config = dict(config or {})
    if spec.startswith("hf:"):
        return load_hf(spec, spec[3:], config)
    if spec in MODEL_NAMES:
        model = _rebuilt(spec, build(spec), config) if config else build(spec)
        return (model, *example_inputs_of(model, spec))
    if ":" not in spec:
        if spec.endswith(".py") and Path(spec).is_file():  # the file without its model: say what it holds
            raise TPCompileError(f"cannot resolve model {spec!r}: name the model in the file as {spec}:NAME; "
                                 f"{_candidates(_import_file(spec, Path(spec)), '')}")
        raise TPCompileError(f"cannot resolve model {spec!r}; accepted forms: {ACCEPTED_FORMS}")
    source, name = spec.rsplit(":", 1)
    if not source or not name:
        raise TPCompileError(f"cannot resolve model {spec!r}; accepted forms: {ACCEPTED_FORMS}")
    is_file = source.endswith(".py")
    module = _import_file(spec, Path(source)) if is_file else _import_module(spec, source)
    model = _instantiate(spec, _getattr_path(spec, module, name, Path(source).name if is_file else source), config)
    return (model, *example_inputs_of(model, spec))


def _rebuilt(spec: str, model: nn.Module, config: dict[str, Any]) -> nn.Module:
    """A bundled model built again with some of its config fields (GPT) or arguments (MLP) replaced."""
    base = getattr(model, "config", None)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # the same seed build() uses, so only the overrides differ
            if dataclasses.is_dataclass(base):
                fields = {f.name for f in dataclasses.fields(base)}
                _check_keys(spec, config, fields)
                return type(model)(dataclasses.replace(base, **config)).eval()
            return type(model)(**config).eval()
    except TPCompileError:
        raise
    except TypeError as exc:
        raise TPCompileError(f"{spec}: --config {_pairs(config)} does not fit {type(model).__name__}: {exc}") from exc
    except ValueError as exc:
        raise TPCompileError(f"{spec}: --config {_pairs(config)} gives an invalid model: {exc}") from exc


def _check_keys(spec: str, config: dict[str, Any], known: set[str]) -> None:
    """Every override names a known field, or a TPCompileError listing the fields."""
    unknown = sorted(set(config) - known)
    if unknown:
        raise TPCompileError(f"{spec}: unknown --config key {unknown[0]!r}; known keys are {', '.join(sorted(known))}")


def _pairs(config: dict[str, Any]) -> str:
    """The overrides as the key=value words they were given as."""
    return " ".join(f"{k}={v}" for k, v in config.items())


def example_inputs_of(model: nn.Module, spec: str = "model") -> tuple[tuple, dict]:
    """The model's own `example_inputs()` as (args, kwargs), or empty when it has none."""
    provider = getattr(model, "example_inputs", None)
    if provider is None:
        return (), {}
    try:
        value = provider() if callable(provider) else provider
    except Exception as exc:
        raise TPCompileError(f"{spec}: example_inputs() failed: {type(exc).__name__}: {exc}") from exc
    if isinstance(value, torch.Tensor):
        return (value,), {}
    if isinstance(value, dict):
        return (), dict(value)
    if isinstance(value, (tuple, list)):
        if len(value) == 2 and isinstance(value[0], (tuple, list)) and isinstance(value[1], dict):
            return tuple(value[0]), dict(value[1])
        return tuple(value), {}
    raise TPCompileError(
        f"{spec}: example_inputs() returned {type(value).__name__}; expected a tensor, a tuple of "
        "arguments, a dict of keyword arguments or an (args, kwargs) pair"
    )


def _import_file(spec: str, path: Path) -> Any:
    """Execute a Python file as a fresh module."""
    if not path.is_file():
        raise TPCompileError(f"cannot resolve model {spec!r}: file {str(path)!r} does not exist")
    path = path.resolve()
    mod_name = f"_tpcompile_user_{path.stem}_{zlib.crc32(str(path).encode()):08x}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    file_spec = importlib.util.spec_from_file_location(mod_name, path)
    if file_spec is None or file_spec.loader is None:
        raise TPCompileError(f"cannot resolve model {spec!r}: {str(path)!r} is not importable Python")
    module = importlib.util.module_from_spec(file_spec)
    # Registered before execution so dataclasses and pickling inside the file can find it.
    sys.modules[mod_name] = module
    # The file's own folder goes on the path while it runs so its sibling imports work.
    sys.path.insert(0, str(path.parent))
    try:
        file_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[mod_name]
        raise TPCompileError(f"cannot resolve model {spec!r}: running {path.name} failed: "
                             f"{type(exc).__name__}: {exc}") from exc
    finally:
        sys.path.remove(str(path.parent))
    return module


def _import_module(spec: str, dotted: str) -> Any:
    """Import a module by its dotted name."""
    # The console script, unlike `python -m`, does not put the working directory on the path.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        return importlib.import_module(dotted)
    except Exception as exc:
        raise TPCompileError(f"cannot resolve model {spec!r}: importing {dotted!r} failed: "
                             f"{type(exc).__name__}: {exc}; accepted forms: {ACCEPTED_FORMS}") from exc


def _getattr_path(spec: str, module: Any, name: str, where: str) -> Any:
    """Follow a possibly dotted attribute name from a module (`where`: the file or module as the user named it)."""
    obj = module
    for part in name.split("."):
        if not hasattr(obj, part):
            owner = where if obj is module else f"{where}:{name.rpartition(part)[0].rstrip('.')}"
            raise TPCompileError(f"cannot resolve model {spec!r}: {owner} has no {part!r}; "
                                 f"{_candidates(obj, part)}")
        obj = getattr(obj, part)
    return obj


def _candidates(obj: Any, missing: str) -> str:
    """What could be meant: the models, classes and functions `obj` defines itself, nearest first."""
    home = getattr(obj, "__name__", None)
    names = sorted(n for n, v in vars(obj).items() if not n.startswith("_") and (
        isinstance(v, nn.Module) or (callable(v) and getattr(v, "__module__", None) == home)))
    if not names:
        return "it defines no nn.Module, class or function"
    close = difflib.get_close_matches(missing, names, n=3)
    listed = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
    return (f"did you mean {', '.join(close)}? " if close else "") + f"it defines: {listed}"


def _instantiate(spec: str, obj: Any, config: dict[str, Any] | None = None) -> nn.Module:
    """Accept a module instance, a module class or a factory (called with the --config overrides)."""
    config = config or {}
    if isinstance(obj, nn.Module):
        if config:
            raise TPCompileError(f"cannot apply --config {_pairs(config)} to {spec!r}: it names a ready-made "
                                 "module instance; name its class or a factory instead")
        return obj
    if not callable(obj):
        kind = type(obj).__name__
        raise TPCompileError(f"cannot resolve model {spec!r}: it names {'an' if kind[0] in 'aeiou' else 'a'} "
                             f"{kind}, not an nn.Module instance, subclass or factory")
    kind = "class" if isinstance(obj, type) else "factory"
    try:
        model = obj(**config)
    except Exception as exc:
        given = f"with {_pairs(config)}" if config else "with no arguments"
        raise TPCompileError(f"cannot resolve model {spec!r}: calling {kind} {getattr(obj, '__name__', obj)} "
                             f"{given} failed: {type(exc).__name__}: {exc}{_missing_hint(obj, config)}") from exc
    if not isinstance(model, nn.Module):
        raise TPCompileError(f"cannot resolve model {spec!r}: the {kind} returned a "
                             f"{type(model).__name__}, not an nn.Module")
    return model


def _missing_hint(obj: Any, config: dict[str, Any]) -> str:
    """'; pass them with --config width=VALUE' for the required arguments of `obj` that --config left out."""
    try:
        params = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return ""
    missing = [p.name for p in params if p.default is inspect.Parameter.empty and p.name not in config
               and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    if not missing:
        return ""
    flags = " ".join(f"--config {name}=VALUE" for name in missing)
    return f"; pass {'it' if len(missing) == 1 else 'them'} with {flags}"
