"""Sharding rules one behaviour at a time, on tiny modules, each with its numerical twin."""
from __future__ import annotations

import pytest
import sympy
import torch
import torch.nn.functional as F
from torch import nn

import tpcompile
from tpcompile.placement import Shard
from tpcompile.sharding_rules.shape import reshape_placement


def _check(model: nn.Module, x: torch.Tensor, ws: int = 2) -> tpcompile.ShardedModel:
    """Shard, then assert every rank equals the original on a new batch."""
    sm = tpcompile.shard(model, ws, example_inputs=(x,))
    x2 = torch.randn(x.shape[0] + 3, *x.shape[1:])
    with torch.no_grad():
        ref = model(x2)
        for out in tpcompile.simulate(sm, x2):
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    return sm


def test_reshape_splits_a_sharded_dim_into_whole_heads() -> None:
    """(B, T, 512) sharded on 512 -> (B, T, 8, 64): whole heads, dim 2."""
    b, t = sympy.Symbol("b"), sympy.Symbol("t")
    out, why = reshape_placement(Shard(2), (b, t, 512), (b, t, 8, 64), 2)
    assert out == Shard(2) and why == ""


def test_reshape_merges_heads_back() -> None:
    """(B, T, 8, 64) sharded on heads -> (B, T, 512): plain shard of the merged dim."""
    b, t = sympy.Symbol("b"), sympy.Symbol("t")
    assert reshape_placement(Shard(2), (b, t, 8, 64), (b, t, 512), 4)[0] == Shard(2)


def test_reshape_of_segmented_dim_finds_the_head_dim() -> None:
    """q|k|v segments (3 x 512) -> (B, T, 3, 8, 64): the heads dim is sharded."""
    b, t = sympy.Symbol("b"), sympy.Symbol("t")
    out, _ = reshape_placement(Shard(2, (512, 512, 512)), (b, t, 1536), (b, t, 3, 8, 64), 2)
    assert out == Shard(3)


def test_reshape_refuses_heads_the_world_size_does_not_divide() -> None:
    """6 heads at 4 ranks cannot be split; the reason names the sizes."""
    out, why = reshape_placement(Shard(1), (5, 48), (5, 6, 8), 4)
    assert out is None and "6 is not divisible by world size 4" in why


def test_reshape_through_flattened_tokens() -> None:
    """(B, T, C) sharded on C -> (B*T, C) -> keeps the shard on the last dim."""
    b, t = sympy.Symbol("b"), sympy.Symbol("t")
    assert reshape_placement(Shard(2), (b, t, 64), (b * t, 64), 2)[0] == Shard(1)


class SwiGLU(nn.Module):
    """gate and up column splits multiplied, down a row split."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(32, 96, bias=False), nn.Linear(32, 96, bias=False), nn.Linear(96, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


def test_swiglu_is_two_columns_and_a_row() -> None:
    """Gated MLP: gate and up column-split, down row-split, one all-reduce."""
    sm = _check(SwiGLU(), torch.randn(4, 32))
    assert sm.plan.modules == {"gate": "column", "up": "column", "down": "row"}
    assert [op for op, _ in sm.collectives()] == ["all_reduce"]


class FusedGateUp(nn.Module):
    """One projection chunked into gate and up (Phi-3 style)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up, self.down = nn.Linear(32, 128), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


def test_fused_gate_up_is_sliced_per_segment() -> None:
    """A fused gate|up projection is split per segment so the chunk stays aligned."""
    sm = _check(FusedGateUp(), torch.randn(4, 32))
    assert sm.plan.parameters["gate_up.weight"].segments == (64, 64)


class NormOverHidden(nn.Module):
    """A column split followed by a norm over the split dim."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.norm = nn.Linear(16, 32), nn.LayerNorm(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x))


def test_norm_over_split_dim_replicates_with_a_named_warning() -> None:
    """A LayerNorm over the column split's output keeps fc whole and says why."""
    with pytest.warns(tpcompile.TPCompileWarning, match=r"aten.layer_norm.default .* normalises over the sharded dim 1; replicating fc"):
        sm = _check(NormOverHidden(), torch.randn(4, 16))
    assert sm.plan.modules["fc"] == "replicated" and sm.collectives() == []


class UnknownOp(nn.Module):
    """An op with no row in the table applied to a split value."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.cummax(self.fc(x), dim=0).values)


def test_op_without_rule_is_replicated_and_named() -> None:
    """aten.cummax has no rule: its region is replicated and the warning names the op."""
    with pytest.warns(tpcompile.TPCompileWarning, match=r"aten.cummax.default .*no sharding rule"):
        sm = _check(UnknownOp(), torch.randn(4, 16))
    assert sm.plan.modules["fc"] == "replicated"


class SoftmaxOverHeads(nn.Module):
    """Softmax over the split features: not allowed, must replicate."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.softmax(self.fc(x), dim=-1))


def test_softmax_over_split_dim_replicates() -> None:
    """Softmax along the split dim needs every feature: the pair stays whole."""
    with pytest.warns(tpcompile.TPCompileWarning, match="needs the whole of dim 1"):
        sm = _check(SoftmaxOverHeads(), torch.randn(4, 16))
    assert sm.plan.modules["fc"] == "replicated"


class EinsumAttention(nn.Module):
    """Attention written with einsum on (B, T, heads, dim) tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(64, 64) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (f(x).view(b, t, 4, 16) for f in (self.q, self.k, self.v))
        att = torch.einsum("bthd,bshd->bhts", q, k).softmax(-1)
        return self.o(torch.einsum("bhts,bshd->bthd", att, v).reshape(b, t, c))


def test_einsum_attention_keeps_whole_heads() -> None:
    """Heads flow through einsum: q/k/v column, o row, one all-reduce."""
    sm = _check(EinsumAttention(), torch.randn(2, 8, 64))
    assert sm.plan.modules == {"q": "column", "k": "column", "v": "column", "o": "row"}
    assert [op for op, _ in sm.collectives()] == ["all_reduce"]


class StackedQKV(nn.Module):
    """qkv projection reshaped to (B, T, 3, heads, dim), permuted and unbound (timm / ViT style)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(64, 192), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, 4, 16).permute(2, 0, 3, 1, 4).unbind(0)
        return self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, c))


def test_stacked_qkv_is_sliced_per_segment() -> None:
    """The (3, heads, dim) reshape makes q|k|v segments, so heads are split, not q from k."""
    sm = _check(StackedQKV(), torch.randn(2, 8, 64))
    assert sm.plan.parameters["qkv.weight"].segments == (64, 64, 64)
    assert sm.plan.modules == {"qkv": "column", "o": "row"}
