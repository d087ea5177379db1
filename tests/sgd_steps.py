"""SGD steps on a module, for tests that compare training on the ranks with training in one process."""
from __future__ import annotations

import math
from typing import Sequence

import torch


def sgd_losses(module: torch.nn.Module, xs: Sequence[torch.Tensor], lr: float) -> list[float]:
    """One SGD step of mean(module(x)^2) per x, in order; the losses before each step."""
    opt, losses = torch.optim.SGD(module.parameters(), lr=lr), []
    for x in xs:
        opt.zero_grad()
        loss = module(x).square().mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def loss_gap(got: Sequence[float], want: Sequence[float], floor: float = 1e-6) -> float:
    """The largest |got - want| / max(|want|, floor) over the steps; inf when the counts differ or a loss is not
    finite (a nan compares false with everything, so a plain max over the steps could pass over it)."""
    if len(got) != len(want) or not all(math.isfinite(v) for v in (*got, *want)):
        return math.inf
    return max(abs(a - b) / max(abs(b), floor) for a, b in zip(got, want))
