"""Parameters the captured forward never reads (a decoder's cross-attention run without an encoder, a head the
forward skips) are cut along dim 0 for storage: each rank holds its share, checkpoints put them back together,
and nothing the model computes changes."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpcompile
from tpcompile.report.plan_table import split_text


class Skips(nn.Module):
    """An MLP block, and a cross-attention-like projection and a head used only when `memory` is given."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(40, 80), nn.Linear(80, 40)
        self.cross = nn.Linear(40, 40)
        self.head = nn.Linear(40, 10)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.down(F.gelu(self.up(x)))
        if memory is not None:
            x = x + self.cross(memory)
        return x


@pytest.mark.parametrize("ws", [2, 3])
def test_unread_parameters_are_cut_for_storage(ws: int) -> None:
    torch.manual_seed(0)
    model = Skips().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, ws, example_inputs=(torch.randn(2, 5, 40),))
    rows = -(-40 // ws)
    for name, shape in [("cross.weight", (rows, 40)), ("cross.bias", (rows,)), ("head.weight", (-(-10 // ws), 40))]:
        p = sm.plan.parameters[name]
        assert (p.role, p.local_shape) == ("unread", shape), (name, p)
    assert split_text(sm.plan.parameters["cross.weight"]).startswith("unread@0")
    assert sm.plan.parameters["up.weight"].role == "column"
    x = torch.randn(3, 7, 40)
    with torch.no_grad():
        ref = model(x)
        for out in tpcompile.simulate(sm, x):
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    merged = sm.merge_state_dicts([sm.rank(r).state_dict() for r in range(ws)])
    for name, t in model.state_dict().items():
        assert torch.equal(merged[name], t), name
    report = tpcompile.check_gradients(model.train(), sm, torch.randn(2, 6, 40))
    assert report.ok, str(report)
