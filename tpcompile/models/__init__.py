"""Bundled example models and the registry that builds them by name."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tpcompile.errors import TPCompileError
from tpcompile.models.gpt import GPT, GPTConfig
from tpcompile.models.mlp import MLPStack

__all__ = ["GPT", "GPTConfig", "MLPStack", "MODEL_NAMES", "build"]

_REGISTRY: dict[str, Callable[[], nn.Module]] = {
    "mlp": lambda: MLPStack(),
    "gpt": lambda: GPT(GPTConfig()),
    "gpt-manual": lambda: GPT(GPTConfig(attention="manual")),
    "gpt-sep": lambda: GPT(GPTConfig(fused_qkv=False, tie_weights=False)),
}

MODEL_NAMES: tuple[str, ...] = tuple(_REGISTRY)


def build(name: str) -> nn.Module:
    """Build the bundled model `name` with a fixed seed, in eval mode."""
    if name not in _REGISTRY:
        raise TPCompileError(f"unknown bundled model {name!r}; bundled models are {', '.join(MODEL_NAMES)}")
    # fork_rng keeps the caller's global RNG stream untouched by the fixed seed.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = _REGISTRY[name]()
    return model.eval()
