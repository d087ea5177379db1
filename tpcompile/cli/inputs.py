"""--inputs specs ('2x16:long', '4x64', '2x8:long:1000') and random inputs shaped like the example ones."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from tpcompile.errors import TPCompileError

DTYPES: dict[str, torch.dtype] = {
    "long": torch.long, "int64": torch.long, "int": torch.int32, "int32": torch.int32, "short": torch.int16,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
    "float": torch.float32, "float32": torch.float32, "double": torch.float64, "float64": torch.float64,
    "half": torch.float16, "float16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}
_SPEC = re.compile(r"^(\d+(?:x\d+)*)(?::([a-z0-9]+))?(?::(\d+))?$")
SPEC_HELP = ("SHAPE[:DTYPE[:HIGH]], e.g. 2x16:long (integers drawn from [0, HIGH); default: the example "
             "input's range or the first embedding's size), 4x64 (float32); "
             f"dtypes: {', '.join(DTYPES)}")


@dataclass(frozen=True)
class InputSpec:
    """One positional input: its shape, dtype and, for integers, the exclusive upper bound of its values."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    high: Optional[int] = None

    def __str__(self) -> str:
        return f"{'x'.join(map(str, self.shape))} {str(self.dtype).removeprefix('torch.')}"


def parse_input_spec(text: str) -> InputSpec:
    """'2x16:long' -> InputSpec((2, 16), torch.long); a TPCompileError saying the format otherwise."""
    m = _SPEC.match(text.strip().lower())
    if m is None:
        raise TPCompileError(f"--inputs {text!r} is not a valid input spec; expected {SPEC_HELP}")
    dims, dtype, high = m.groups()
    if dtype is not None and dtype not in DTYPES:
        raise TPCompileError(f"--inputs {text!r}: unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    shape = tuple(int(d) for d in dims.split("x"))
    if 0 in shape:
        raise TPCompileError(f"--inputs {text!r}: every dimension must be at least 1")
    kind = DTYPES[dtype or "float"]
    if high is not None and (kind.is_floating_point or kind == torch.bool):
        raise TPCompileError(f"--inputs {text!r}: a value bound (:{high}) only applies to integer dtypes")
    if high is not None and int(high) < 1:
        raise TPCompileError(f"--inputs {text!r}: the value bound must be at least 1")
    return InputSpec(shape, kind, None if high is None else int(high))


def first_embedding(model: nn.Module) -> Optional[tuple[str, nn.Embedding]]:
    """The first nn.Embedding and its path: the token embedding in the usual layouts (positions come after it)."""
    return next(((name, m) for name, m in model.named_modules() if isinstance(m, nn.Embedding)), None)


def first_layer(model: nn.Module) -> Optional[tuple[str, nn.Module]]:
    """The first module holding parameters of its own, and its path."""
    return next(((name, m) for name, m in model.named_modules() if list(m.parameters(recurse=False))), None)


def check_specs(texts: list[str], specs: list[InputSpec], model: nn.Module, name: str, example_args: tuple,
                example_kwargs: dict) -> None:
    """Refuse, before anything runs, --inputs the model cannot take: floats where it takes token ids,
    ids beyond its vocabulary."""
    likes = list(example_args) + [v for v in example_kwargs.values() if isinstance(v, torch.Tensor)]
    layer, emb = first_layer(model), first_embedding(model)
    for i, (text, spec) in enumerate(zip(texts, specs)):
        like = likes[i] if i < len(likes) else None
        integer_like = isinstance(like, torch.Tensor) and not like.is_floating_point() and like.dtype != torch.bool
        if spec.dtype.is_floating_point:
            why = None
            if integer_like:
                why = f"its example input {i + 1} is {str(like.dtype).removeprefix('torch.')}"
            elif like is None and i == 0 and layer is not None and isinstance(layer[1], nn.Embedding):
                why = f"its first layer {layer[0]} is an Embedding"
            if why is not None:
                dims = "x".join(map(str, spec.shape))
                raise TPCompileError(f"--inputs {text!r} gives {str(spec.dtype).removeprefix('torch.')} values, but "
                                     f"{name} takes integer token ids there ({why}); write --inputs {dims}:long")
        if i == 0 and spec.high is not None and emb is not None and spec.high > emb[1].num_embeddings:
            path, rows = emb[0], emb[1].num_embeddings
            raise TPCompileError(f"--inputs {text!r} draws token ids up to {spec.high - 1}, but {name}'s first "
                                 f"embedding {path} has {rows} rows (ids 0..{rows - 1}); use --inputs "
                                 f"{text.strip().rpartition(':')[0]}:{rows} or leave out the bound")


def suggest_inputs(model: nn.Module) -> str:
    """An --inputs example for a model without example inputs, read off its first layer."""
    layer = first_layer(model)
    if layer is not None and isinstance(layer[1], nn.Embedding):
        return f"--inputs 2x8:long (its first layer {layer[0]} is an Embedding of {layer[1].num_embeddings} rows)"
    if layer is not None and isinstance(layer[1], nn.Linear):
        n = layer[1].in_features
        return f"--inputs 2x{n} (its first layer {layer[0]} is a Linear of {n} inputs)"
    return "--inputs 2x16:long for token ids, --inputs 4x64 for float features"


def _default_high(model: nn.Module, like: Any) -> int:
    """Integer inputs are drawn below this: the example input's max + 1, else the first embedding's size, else 2."""
    if isinstance(like, torch.Tensor) and not like.is_floating_point() and like.numel():
        return int(like.max()) + 1
    emb = first_embedding(model)
    return emb[1].num_embeddings if emb is not None else 2


def make_input(spec: InputSpec, model: nn.Module, like: Any, gen: torch.Generator) -> torch.Tensor:
    """A random tensor for one spec (integers below HIGH or the default bound, floats standard normal)."""
    if spec.dtype == torch.bool:
        return torch.randint(0, 2, spec.shape, generator=gen).bool()
    if spec.dtype.is_floating_point:
        return torch.randn(spec.shape, generator=gen).to(spec.dtype)
    high = spec.high or _default_high(model, like)
    return torch.randint(0, high, spec.shape, generator=gen).to(spec.dtype)


def inputs_from_specs(specs: list[InputSpec], model: nn.Module, example_args: tuple, example_kwargs: dict,
                      seed: int) -> tuple[tuple, dict]:
    """Positional inputs from the specs; the example's non-tensor keyword arguments (use_cache=False) kept."""
    gen = torch.Generator().manual_seed(seed)
    # an hf model's example is all keywords: the first keyword tensor stands in for the first positional input
    likes = list(example_args) + [v for v in example_kwargs.values() if isinstance(v, torch.Tensor)]
    args = tuple(make_input(s, model, likes[i] if i < len(likes) else None, gen) for i, s in enumerate(specs))
    kwargs = {k: v for k, v in example_kwargs.items() if not isinstance(v, torch.Tensor)}
    return args, kwargs


def _like(value: Any, gen: torch.Generator) -> Any:
    """A fresh random tensor of value's shape and dtype: normal floats, integers within value's own range."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.is_floating_point():
        return torch.randn(value.shape, generator=gen).to(value.dtype)
    if value.numel() == 0:
        return value.clone()
    low, high = int(value.min()), int(value.max())
    out = torch.randint(low, high + 1, value.shape, generator=gen)
    return out.bool() if value.dtype == torch.bool else out.to(value.dtype)


def random_like(args: tuple, kwargs: dict, seed: int) -> tuple[tuple, dict]:
    """New random inputs with the shapes and dtypes of (args, kwargs)."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(_like(a, gen) for a in args), {k: _like(v, gen) for k, v in kwargs.items()}


def describe_inputs(args: tuple, kwargs: dict) -> str:
    """'2x16 int64' per tensor input, keyword inputs by name."""
    def one(v: Any) -> str:
        if isinstance(v, torch.Tensor):
            return f"{'x'.join(map(str, v.shape)) or 'scalar'} {str(v.dtype).removeprefix('torch.')}"
        return repr(v)
    parts = [one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()]
    return ", ".join(parts) or "none"
