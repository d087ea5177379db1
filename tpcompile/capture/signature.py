"""Forwards taking *args or **kwargs get an explicit signature for the export.

torch.export matches `dynamic_shapes` to the forward's parameters but traces extra keyword
arguments as if they were parameters of their own, so a `forward(self, x, **kwargs)` called
with `scale=...` cannot be given dynamic shapes either way ("Must provide a tree_name ...").
While capturing, the model's forward is replaced by a function whose parameters are exactly
the arguments of this call, each passed on as the user passed it; the module tree, parameter
names and calling convention stay the same.
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Any, Iterator

from torch import nn

_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def needs_explicit_signature(model: nn.Module, args: tuple, kwargs: dict) -> bool:
    """True when this call fills a *args or **kwargs parameter of forward."""
    sig = inspect.signature(model.forward)
    bound = sig.bind(*args, **kwargs).arguments
    return any(sig.parameters[name].kind in _VARIADIC and value for name, value in bound.items())


@contextmanager
def explicit_signature(model: nn.Module, args: tuple, kwargs: dict) -> Iterator[None]:
    """While active, `model.forward` has one named parameter per argument of this call."""
    if not needs_explicit_signature(model, args, kwargs):
        yield
        return
    original = model.forward
    sig = inspect.signature(original)
    bound = sig.bind(*args, **kwargs).arguments
    positional, keywords = [], []
    for name, value in bound.items():
        kind = sig.parameters[name].kind
        if kind == inspect.Parameter.VAR_POSITIONAL:
            positional += [f"{name}_{i}" for i in range(len(value))]
        elif kind == inspect.Parameter.VAR_KEYWORD:
            keywords += list(value)
        elif kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD) and \
                name not in kwargs:
            positional.append(name)
        else:
            keywords.append(name)

    def forward(*a: Any, **kw: Any) -> Any:
        return original(*a, **kw)

    params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_ONLY) for n in positional]
    params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in keywords]
    forward.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    model.forward = forward  # an instance attribute: nn.Module.__call__ finds it first
    try:
        yield
    finally:
        del model.forward
