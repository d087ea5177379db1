"""A parameter cut by a wish (param_cuts.py) can keep a conflict alive after the seed it followed is replicated:
read split as the previous round cut it, the op combining it with the now whole value still wants it split. Such
parameters are kept whole (PassContext.unwished) and the conflict is judged again: the seed's replication is the
only outcome, with its warning, instead of "cannot place these ops on split inputs"."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import tpcompile


class ScaledCumsum(nn.Module):
    """A column split scaled by a parameter of its width, then a cumulative sum over that width (no split rule)."""

    def __init__(self, shift: bool) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)
        self.scale = nn.Parameter(torch.randn(32))
        self.shift = nn.Parameter(torch.randn(32)) if shift else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x) * self.scale
        if self.shift is not None:  # two wished parameters: each is read split because the other was
            h = h + self.shift
        return self.down(torch.cumsum(h, -1))


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("shift", [False, True])
def test_wished_cut_that_keeps_a_conflict_alive_is_dropped(ws: int, shift: bool) -> None:
    torch.manual_seed(0)
    model = ScaledCumsum(shift).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sm = tpcompile.shard(model, ws, example_inputs=(torch.randn(2, 5, 16),))
    texts = [str(w.message) for w in caught if issubclass(w.category, tpcompile.TPCompileWarning)]
    assert len(texts) == 1 and "aten.cumsum" in texts[0] and "replicating up" in texts[0], texts
    for name in ["scale"] + (["shift"] if shift else []):
        assert sm.plan.parameters[name].local_shape == (32,), sm.plan.parameters[name]
    assert sm.plan.parameters["up.weight"].local_shape == (32, 16)
    x = torch.randn(3, 7, 16)
    with torch.no_grad():
        ref = model(x)
        for out in tpcompile.simulate(sm, x):
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
