"""A stack of Linear layers with an activation between them."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

_ACTIVATIONS: dict[str, type[nn.Module]] = {
    "gelu": nn.GELU,
    "relu": nn.ReLU,
    "silu": nn.SiLU,
    "tanh": nn.Tanh,
}


class MLPStack(nn.Module):
    """Linear layers of the given widths, with the activation between consecutive layers."""

    def __init__(self, dims: Sequence[int] = (64, 256, 64, 256, 64), activation: str = "gelu") -> None:
        """Build len(dims) - 1 Linear layers; no activation after the last one."""
        super().__init__()
        if len(dims) < 2:
            raise ValueError(f"MLPStack needs at least two dims, got {list(dims)}")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; choose one of {sorted(_ACTIVATIONS)}")
        self.dims = tuple(int(d) for d in dims)
        layers: list[nn.Module] = []
        for i, (d_in, d_out) in enumerate(zip(self.dims[:-1], self.dims[1:])):
            layers.append(nn.Linear(d_in, d_out))
            if i < len(self.dims) - 2:
                layers.append(_ACTIVATIONS[activation]())
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map (..., dims[0]) to (..., dims[-1])."""
        return self.layers(x)

    def example_inputs(self) -> tuple[torch.Tensor]:
        """A fixed (4, dims[0]) float input, the same on every call."""
        gen = torch.Generator().manual_seed(0)
        return (torch.randn(4, self.dims[0], generator=gen),)
