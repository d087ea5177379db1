"""torch.distributions checks its arguments' values at construction (a data-dependent branch torch.export cannot
trace): capture runs with those checks off and turns them back on after, so a model that computes an entropy
(BLT's patching does) shards, equals the original, and the user's setting is kept."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import tpcompile


class EntropyGate(nn.Module):
    """An MLP whose output is scaled per token by the entropy of a small head's distribution."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.head = nn.Linear(32, 64), nn.Linear(64, 32), nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        entropy = torch.distributions.Categorical(logits=self.head(x)).entropy()
        return x + self.down(torch.relu(self.up(x))) * entropy.unsqueeze(-1)


@pytest.mark.parametrize("validate", [True, False])
def test_distribution_value_checks_are_off_only_while_capturing(validate: bool) -> None:
    saved = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(validate)
    try:
        torch.manual_seed(0)
        model = EntropyGate().eval()
        sm = tpcompile.shard(model, 2, example_inputs=(torch.randn(2, 5, 32),))
        assert torch.distributions.Distribution._validate_args is validate
        assert sm.plan.parameters["up.weight"].role == "column"
        x = torch.randn(3, 7, 32)
        with torch.no_grad():
            ref = model(x)
            for out in tpcompile.simulate(sm, x):
                torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    finally:
        torch.distributions.Distribution.set_default_validate_args(saved)
