"""SGD steps on a module, for tests that compare training on the ranks with training in one process."""
from __future__ import annotations

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
