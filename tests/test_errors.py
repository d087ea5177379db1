"""Bad input gets a TPCompileError that names the value and the way out."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import tpcompile
from tpcompile.models import build


@pytest.mark.parametrize("ws", [0, -2, 1.5, "2", True, None])
def test_bad_world_size(ws: object) -> None:
    """world_size must be an int >= 1; the message repeats the value given."""
    with pytest.raises(tpcompile.TPCompileError, match=r"world_size must be an int >= 1, got " + repr(ws).replace(".", r"\.")):
        tpcompile.shard(build("mlp"), ws)


def test_error_is_a_value_error() -> None:
    """TPCompileError is a ValueError, so generic handlers catch it."""
    assert issubclass(tpcompile.TPCompileError, ValueError)


def test_plan_naming_missing_module() -> None:
    """A plan key that is no module of the model is named, with close matches suggested."""
    with pytest.raises(tpcompile.TPCompileError, match=r"'transformer\.h\.0\.atn'.*did you mean transformer\.h\.0\.attn"):
        tpcompile.shard(build("gpt"), 2, plan={"transformer.h.0.atn": "replicate"})


def test_plan_with_unknown_value() -> None:
    """A plan value outside the accepted ones is rejected, listing them."""
    with pytest.raises(tpcompile.TPCompileError, match="use one of auto, replicate, sharded_output"):
        tpcompile.shard(build("gpt"), 2, plan={"lm_head": "rowwise"})


class DataDependent(nn.Module):
    """A model whose Python control flow depends on tensor values."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.fc(x)
        return -self.fc(x)


def test_uncapturable_model() -> None:
    """torch.export failure says what failed and what to try."""
    with pytest.raises(tpcompile.TPCompileError, match=r"torch.export could not capture DataDependent: .*\n  try: .*torch.cond"):
        tpcompile.shard(DataDependent(), 2, example_inputs=(torch.randn(2, 8),))


class ConvFirst(nn.Module):
    """A model whose first layer is no Linear or Embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(3, 8, 3)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x).mean(-1))


def test_no_example_inputs_and_none_inferable() -> None:
    """Without example inputs and a Conv first layer, the error says what to pass."""
    with pytest.raises(tpcompile.TPCompileError, match=r"first layer conv is a Conv1d.*pass example_inputs="):
        tpcompile.shard(ConvFirst(), 2)


def test_inputs_inferred_from_first_linear() -> None:
    """With no example inputs, a Linear-first model is captured from a guessed input."""
    model = build("mlp")
    sm = tpcompile.shard(model, 2)
    x = torch.randn(5, 64)
    with torch.no_grad():
        torch.testing.assert_close(tpcompile.simulate(sm, x)[0], model(x), atol=1e-5, rtol=0)


def test_bad_rank_index() -> None:
    """Asking for a rank outside the world is an error naming the rank."""
    sm = tpcompile.shard(build("mlp"), 2)
    with pytest.raises(tpcompile.TPCompileError, match="rank 2 is out of range for world size 2"):
        sm.rank(2)
