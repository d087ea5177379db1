"""A hand-written Megatron-style split of tpcompile.models.MLPStack: column, activation, row, repeat."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpcompile.models.mlp import MLPStack

from bench.megatron_comm import CommLog

__all__ = ["TPMLPStack"]


def _chunk(t: torch.Tensor, dim: int, rank: int, ws: int) -> nn.Parameter:
    """Rank's contiguous equal chunk of t along dim as its own Parameter."""
    if t.shape[dim] % ws:
        raise ValueError(f"size {t.shape[dim]} of dim {dim} is not divisible by world size {ws}")
    n = t.shape[dim] // ws
    return nn.Parameter(t.detach().narrow(dim, rank * n, n).clone())


class TPMLPStack(nn.Module):
    """Rank `rank` of a world-size `ws` split: layer pairs (column, row), one all-reduce per pair."""

    def __init__(self, model: MLPStack, rank: int, ws: int) -> None:
        """Slice odd linears by output rows (column), even ones by input columns (row)."""
        super().__init__()
        linears = [m for m in model.layers if isinstance(m, nn.Linear)]
        if len(linears) % 2:
            raise ValueError(f"an MLPStack of {len(linears)} linears does not pair into column/row")
        self.acts = [m for m in model.layers if not isinstance(m, nn.Linear)]
        self.comm = CommLog()
        self.weights = nn.ParameterList()
        self.biases = nn.ParameterList()
        for i, lin in enumerate(linears):
            if i % 2 == 0:  # column: output features split, bias split with them
                self.weights.append(_chunk(lin.weight, 0, rank, ws))
                self.biases.append(_chunk(lin.bias, 0, rank, ws))
            else:  # row: input features split, full bias added once after the sum
                self.weights.append(_chunk(lin.weight, 1, rank, ws))
                self.biases.append(nn.Parameter(lin.bias.detach().clone()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., d_in) replicated -> (..., d_out) replicated."""
        for i in range(0, len(self.weights), 2):
            h = F.linear(self.comm.copy(x), self.weights[i], self.biases[i])
            h = self.acts[i](h)
            x = self.comm.all_reduce(F.linear(h, self.weights[i + 1])) + self.biases[i + 1]
            if i + 1 < len(self.acts):
                x = self.acts[i + 1](x)
        return x
