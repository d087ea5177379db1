"""A weight that a matmul reads in pieces (`w.split(...)`, then a linear per piece) stays whole on every rank:
shard() says so by name, with the way out, and the results stay exact."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpcompile


class PackedKV(nn.Module):
    """A query projection and one packed key/value weight cut in two by rows, a linear per piece."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.d = d
        self.q = nn.Linear(d, d)
        self.kv = nn.Parameter(torch.randn(2 * d, d) / d ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wk, wv = self.kv.split(self.d)
        return self.q(x) * F.linear(x, wk) + F.linear(x, wv)


class Net(nn.Module):
    """PackedKV, then a column/row MLP."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.attn = PackedKV(d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.down(F.gelu(self.up(x)))


def _shard(model: nn.Module, *inputs: torch.Tensor, **kw) -> tuple[tpcompile.ShardedModel, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, 2, example_inputs=inputs, **kw)
    return sm, [str(w.message) for w in caught if issubclass(w.category, tpcompile.TPCompileWarning)]


def _exact(sm: tpcompile.ShardedModel, model: nn.Module, *inputs: torch.Tensor) -> None:
    with torch.no_grad():
        ref = model(*inputs)
        for out in tpcompile.simulate(sm, *inputs):
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_a_weight_read_in_pieces_is_named_and_the_plan_silences_it() -> None:
    """One warning naming the parameter, its shape, the split and the linear, and the plan entry that silences it;
    with that entry, no warning. The MLP still splits; every rank equals the original."""
    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(2, 5, 32)
    sm, said = _shard(model, x)
    assert len(said) == 1 and said == sm.plan.warnings
    msg = said[0]
    for part in ("attn.kv (64, 32)", "aten.split", "aten.linear.default", "stays whole on every rank",
                 "one nn.Linear each", "plan={'attn': 'replicate'}"):
        assert part in msg, (part, msg)
    assert sm.plan.parameters["attn.kv"].role == "replicated"
    assert "replicated" not in (sm.plan.modules["up"], sm.plan.modules["down"])
    _exact(sm, model, x)
    quiet, said = _shard(model, x, plan={"attn": "replicate"})
    assert not said and not quiet.plan.warnings
    _exact(quiet, model, x)


def test_a_top_level_weight_read_in_pieces_is_named() -> None:
    """A top-level parameter: no plan entry names it alone, and the warning says so instead of offering one."""
    torch.manual_seed(0)
    model = PackedKV().eval()
    x = torch.randn(2, 5, 32)
    sm, said = _shard(model, x)
    assert len(said) == 1 and "kv (64, 32)" in said[0] and "top-level module" in said[0]
    assert "plan=" not in said[0]
    _exact(sm, model, x)


@pytest.mark.parametrize("layers", [1, 2])
def test_cross_attention_in_proj_is_named(layers: int) -> None:
    """nn.TransformerDecoder's cross-attention splits its packed in_proj_weight into query and key/value rows:
    each layer's is named; self-attention's, read whole and split by heads, is not."""
    torch.manual_seed(0)
    layer = nn.TransformerDecoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    model = nn.TransformerDecoder(layer, layers).eval()
    x, memory = torch.randn(2, 7, 64), torch.randn(2, 5, 64)
    sm, said = _shard(model, x, memory)
    named = [w for w in said if "reads a piece of" in w]
    assert [f"layers.{i}.multihead_attn.in_proj_weight (192, 64)" in w for i, w in enumerate(named)] == [True] * layers
    assert not any("self_attn.in_proj_weight" in w for w in said)
    assert sm.plan.parameters["layers.0.self_attn.in_proj_weight"].segments == (64, 64, 64)
    _exact(sm, model, x, memory)


class SlicedPositions(nn.Module):
    """Learned positions sliced to the length (`pos[:T]`) and added to the input, then a column/row MLP."""

    def __init__(self, d: int = 32, block: int = 16) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(block, d))
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.pos[: x.shape[1]]
        return h + self.down(F.gelu(self.up(h)))


def test_a_piece_mixed_into_activations_is_not_a_weight_read_in_pieces() -> None:
    """A slice of a parameter added to the activations reaches the MLP's matmuls as their input, not as a weight:
    no warning."""
    torch.manual_seed(0)
    model = SlicedPositions().eval()
    x = torch.randn(2, 5, 32)
    sm, said = _shard(model, x)
    assert not said
    _exact(sm, model, x)
