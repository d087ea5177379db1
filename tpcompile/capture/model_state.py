"""Leave the user's model as it was found: capture runs forward on fake tensors, and a forward that
stores what it computes (a cached mask, a rotary table, `self.last = x`) would keep the fake tensor."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn


@contextmanager
def model_state_kept(model: nn.Module) -> Iterator[None]:
    """Restore every submodule's attributes, parameters, buffers and children on exit."""
    saved = [(m, dict(m.__dict__), dict(m._parameters), dict(m._buffers), dict(m._modules))
             for m in model.modules()]
    try:
        yield
    finally:
        for m, attrs, params, buffers, children in saved:
            m.__dict__.clear()
            m.__dict__.update(attrs)
            # the dicts themselves are the originals (restored above); their contents may have changed
            for live, kept in ((m._parameters, params), (m._buffers, buffers), (m._modules, children)):
                live.clear()
                live.update(kept)


@contextmanager
def value_checks_off() -> Iterator[None]:
    """torch.distributions checks the values of its arguments (`Categorical(logits=...)` asks whether they are
    finite, a data-dependent branch that torch.export cannot trace). The check computes nothing and only raises
    on invalid values, so capture runs with it off; the rank graphs do not repeat it."""
    saved = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(False)
    try:
        yield
    finally:
        torch.distributions.Distribution.set_default_validate_args(saved)
