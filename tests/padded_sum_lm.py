"""A tiny language model whose hidden width (50, zero-padded to 52 at 4 ranks) is also summed: a statistic over a
padded dim in a training run (tests/test_padding.py trains it under torchrun)."""
from __future__ import annotations

import torch
from torch import nn


class PadLM(nn.Module):
    """Token ids -> logits, through a hidden width of 50 that is both projected back and summed."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.up, self.down = nn.Linear(32, 50, bias=False), nn.Linear(50, 32, bias=False)
        self.head = nn.Linear(32, 64, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        h = self.up(x)
        x = x + self.down(torch.relu(h)) + h.sum(-1, keepdim=True)
        return self.head(x)
