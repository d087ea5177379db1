"""Repeated layers that are alike are captured three times, not n times: the planner copies the middle one.

A 32-layer model spends most of its planning time in torch.export tracing 32 copies of one
layer. When every layer of the repeated container has the same type, the same parameter and
buffer shapes, the same submodules (type and `extra_repr`) and the same plain attributes (an
attribute equal to the layer's own position, like Hugging Face's `layer_idx`, is allowed to
differ), the planner captures the model with only the first, second and last layer left in
the container, under their own names (`model.layers.0`, `.1`, `.31`), and then prices layers
2 .. n-2 as copies of layer 1 (profile.expand_copies, tp_profile). Anything that makes the
shortened model fail to capture, or the second and last layers cost differently, falls back
to capturing every layer.
"""
from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from typing import Any, Iterator

from torch import nn

PLAIN = (bool, int, float, str, type(None))
KEPT = 3  # first, second (the template of the middle ones) and last


def _attributes(module: nn.Module) -> dict[str, Any]:
    """The plain (non-tensor, non-module) attributes of one module."""
    return {k: v for k, v in vars(module).items() if not k.startswith("_") and isinstance(v, PLAIN)}


def _signature(layer: nn.Module) -> tuple:
    """Everything that must agree between alike layers, except the plain attributes."""
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in layer.named_parameters())
    buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in layer.named_buffers())
    modules = tuple((n, type(m), m.extra_repr()) for n, m in layer.named_modules())
    return params, buffers, modules


def alike(layers: list[nn.Module]) -> bool:
    """True when the layers are interchangeable for costing (see the module docstring)."""
    if len(layers) < 2 or len({id(m) for m in layers}) != len(layers):
        return False  # a layer object repeated shares its parameters: keep every use
    first = _signature(layers[0])
    if any(_signature(m) != first for m in layers[1:]):
        return False
    per_layer = [[_attributes(m) for _, m in layer.named_modules()] for layer in layers]
    for j in range(len(per_layer[0])):
        keys = set(per_layer[0][j])
        if any(set(attrs[j]) != keys for attrs in per_layer):
            return False
        for key in keys:
            values = [attrs[j][key] for attrs in per_layer]
            if all(v == values[0] for v in values):
                continue
            if not all(type(v) is int and v == k for k, v in enumerate(values)):  # noqa: E721 (bool is not a position)
                return False
    return True


def container_of(model: nn.Module, paths: list[str]) -> nn.Module | None:
    """The ModuleList / Sequential holding the layers at `paths` (siblings), or None."""
    parent = paths[0].rpartition(".")[0]
    if any(p.rpartition(".")[0] != parent for p in paths):
        return None
    try:
        return model.get_submodule(parent) if parent else model
    except AttributeError:
        return None


@contextmanager
def shortened(container: nn.Module) -> Iterator[list[str]]:
    """The container holding only its first, second and last layer, under their own names; their keys."""
    saved = container._modules
    keys = list(saved)
    kept = [keys[0], keys[1], keys[-1]]
    container._modules = OrderedDict((k, saved[k]) for k in kept)
    try:
        yield kept
    finally:
        container._modules = saved
