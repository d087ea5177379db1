"""Weights read in pieces: row pieces that one linear each reads (`w.split(...)`, nn.MultiheadAttention's
cross-attention `in_proj_weight`) split as weights of their own; any other piece read (a weight cut along its
input features) stays whole on every rank, and shard() says so by name, with the way out. Results stay exact."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpcompile


class PackedKV(nn.Module):
    """A query projection and one packed key/value weight cut in two by rows, a linear per piece."""

    def __init__(self, d: int = 32, cut: str = "split") -> None:
        super().__init__()
        self.d, self.cut = d, cut
        self.q = nn.Linear(d, d)
        self.kv = nn.Parameter(torch.randn(2 * d, d) / d ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wk, wv = self.kv.split(self.d) if self.cut == "split" else (self.kv[:self.d], self.kv[self.d:])
        return self.q(x) * F.linear(x, wk) + F.linear(x, wv)


class Net(nn.Module):
    """PackedKV, then a column/row MLP."""

    def __init__(self, d: int = 32, cut: str = "split") -> None:
        super().__init__()
        self.attn = PackedKV(d, cut)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.down(F.gelu(self.up(x)))


def _shard(model: nn.Module, *inputs: torch.Tensor, ws: int = 2, **kw) -> tuple[tpcompile.ShardedModel, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, ws, example_inputs=inputs, **kw)
    return sm, [str(w.message) for w in caught if issubclass(w.category, tpcompile.TPCompileWarning)]


def _exact(sm: tpcompile.ShardedModel, model: nn.Module, *inputs: torch.Tensor) -> None:
    with torch.no_grad():
        ref = model(*inputs)
        for out in tpcompile.simulate(sm, *inputs):
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


class ColumnsCut(nn.Module):
    """One weight cut along its input features (`w[:, :d]`, `w[:, d:]`), a linear per piece on two inputs."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.d = d
        self.w = nn.Parameter(torch.randn(d, 2 * d) / d ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w[:, :self.d]) + F.linear(x.sin(), self.w[:, self.d:])


class CutNet(nn.Module):
    """ColumnsCut, then a column/row MLP."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.cut = ColumnsCut(d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.cut(x)
        return x + self.down(F.gelu(self.up(x)))


def _grads_agree(sm: tpcompile.ShardedModel, model: nn.Module, *inputs: torch.Tensor) -> None:
    report = tpcompile.check_gradients(model, sm, *inputs)
    assert report.ok, str(report)


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("cut", ["split", "slice"])
def test_row_pieces_split_as_weights_of_their_own(cut: str, ws: int) -> None:
    """A packed k|v weight cut in two by rows (split, or two slices), a linear per piece: each piece is split like
    a linear of its own, the parameter cut per piece (k[r] | v[r] on rank r); no warning, forward and gradients
    equal the original."""
    torch.manual_seed(0)
    model = Net(cut=cut).eval()
    sm, said = _shard(model, torch.randn(2, 5, 32), ws=ws)
    assert not said
    kv = sm.plan.parameters["attn.kv"]
    assert kv.role == "column" and kv.segments == (32, 32) and kv.local_shape == (64 // ws, 32)
    other = torch.randn(3, 7, 32)
    _exact(sm, model, other)
    _grads_agree(sm, model, other)


def test_a_weight_read_in_pieces_is_named_and_the_plan_silences_it() -> None:
    """A weight cut along its input features: one warning naming the parameter, its shape, the cut and the
    linear, and the plan entry that silences it; with that entry, no warning. The MLP still splits; every rank
    equals the original."""
    torch.manual_seed(0)
    model = CutNet().eval()
    x = torch.randn(2, 5, 32)
    sm, said = _shard(model, x)
    assert len(said) == 1 and said == sm.plan.warnings
    msg = said[0]
    for part in ("cut.w (32, 64)", "aten.slice", "aten.linear.default", "stays whole on every rank",
                 "one nn.Linear each", "plan={'cut': 'replicate'}"):
        assert part in msg, (part, msg)
    assert sm.plan.parameters["cut.w"].role == "replicated"
    assert "replicated" not in (sm.plan.modules["up"], sm.plan.modules["down"])
    _exact(sm, model, x)
    quiet, said = _shard(model, x, plan={"cut": "replicate"})
    assert not said and not quiet.plan.warnings
    _exact(quiet, model, x)


def test_a_top_level_weight_read_in_pieces_is_named() -> None:
    """A top-level parameter: no plan entry names it alone, and the warning says so instead of offering one."""
    torch.manual_seed(0)
    model = ColumnsCut().eval()
    x = torch.randn(2, 5, 32)
    sm, said = _shard(model, x)
    assert len(said) == 1 and "w (32, 64)" in said[0] and "top-level module" in said[0]
    assert "plan=" not in said[0]
    _exact(sm, model, x)


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("layers", [1, 2])
def test_cross_attention_in_proj_splits_by_heads(layers: int, ws: int) -> None:
    """nn.TransformerDecoder's cross-attention cuts its packed in_proj_weight into query and key/value rows: both
    pieces split by heads (the parameter q[r] | k[r] | v[r] on rank r, as self-attention's), no warning, one
    all-reduce per attention and MLP (3 per layer); forward and gradients equal the original at another batch and
    lengths."""
    torch.manual_seed(0)
    layer = nn.TransformerDecoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    model = nn.TransformerDecoder(layer, layers).eval()
    sm, said = _shard(model, torch.randn(2, 7, 64), torch.randn(2, 5, 64), ws=ws)
    assert not said
    for i in range(layers):
        for name in ("self_attn", "multihead_attn"):
            p = sm.plan.parameters[f"layers.{i}.{name}.in_proj_weight"]
            assert p.role == "column" and p.segments == (64, 64, 64) and p.local_shape == (192 // ws, 64)
        assert sm.plan.parameters[f"layers.{i}.multihead_attn.in_proj_bias"].local_shape == (192 // ws,)
        assert sm.plan.modules[f"layers.{i}.multihead_attn.out_proj"] == "row"
    assert [op for op, _ in sm.collectives()] == ["all_reduce"] * (3 * layers)
    x, memory = torch.randn(3, 9, 64), torch.randn(3, 4, 64)
    _exact(sm, model, x, memory)
    _grads_agree(sm, model, x, memory)


class ThreeInputs(nn.Module):
    """nn.MultiheadAttention on distinct query, key and value: its in_proj_weight cut by chunk(3)."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(d, heads, batch_first=True)

    def forward(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.mha(x, k, v, need_weights=False)[0]


def test_query_key_value_pieces_split_by_heads() -> None:
    """Three pieces cut by chunk, one linear each: every piece split by heads at 2 ranks, exact, gradients equal."""
    torch.manual_seed(0)
    model = ThreeInputs().eval()
    sm, said = _shard(model, torch.randn(2, 5, 32), torch.randn(2, 6, 32), torch.randn(2, 6, 32))
    assert not said and sm.plan.parameters["mha.in_proj_weight"].segments == (32, 32, 32)
    inputs = (torch.randn(3, 4, 32), torch.randn(3, 3, 32), torch.randn(3, 3, 32))
    _exact(sm, model, *inputs)
    _grads_agree(sm, model, *inputs)


def test_pieces_whose_heads_the_ranks_do_not_divide_stay_whole_with_the_reason() -> None:
    """3 heads at 2 ranks: the pieces stay whole, and the warning gives the reason (the heads of 16, found through
    the view that folds them with the batch, do not split 2 ways), not a piece read; every rank equals the
    original."""
    torch.manual_seed(0)
    model = ThreeInputs(48, 3).eval()
    inputs = (torch.randn(2, 5, 48), torch.randn(2, 6, 48), torch.randn(2, 6, 48))
    sm, said = _shard(model, *inputs)
    assert sm.plan.parameters["mha.in_proj_weight"].role == "replicated"
    assert said and not any("reads a piece of" in w for w in said)
    assert any("(segments (48,)) does not split into whole heads on each of 2 ranks" in w and "replicating mha" in w
               for w in said), said
    _exact(sm, model, *inputs)


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


class ExpertsThenCumsum(nn.Module):
    """Experts picked out of one (experts, out, in) weight (a rule splits those by the experts' rows), whose sum
    then goes through a cumulative sum along the features, which needs them whole."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 16, 8))
        self.o = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = sum(F.linear(x, self.w[e]) for e in range(2))
        return self.o(torch.cumsum(y, dim=-1))


def test_experts_picked_by_id_and_kept_whole_for_another_reason_are_warned_once() -> None:
    """The experts' weight stays whole because of the cumulative sum, which is the one warning: not a second one
    saying that no rule splits a piece picked by `w[e]` (one does; the warning would send the user the wrong way)."""
    torch.manual_seed(0)
    model = ExpertsThenCumsum()
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        sm = tpcompile.shard(model, 2, example_inputs=(torch.randn(3, 8),))
    said = [str(w.message) for w in got if issubclass(w.category, tpcompile.TPCompileWarning)]
    assert len(said) == 1 and "cumsum" in said[0], said
    assert sm.plan.parameters["w"].role == "replicated"
    x = torch.randn(5, 8)
    with torch.no_grad():
        for out in tpcompile.simulate(sm, x):
            torch.testing.assert_close(out, model(x), atol=1e-5, rtol=0)
