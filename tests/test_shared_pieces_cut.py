"""Values in fewer pieces than ranks meeting evenly split ones: key heads fewer than the ranks, repeated over the
value heads, are held in pieces each shared by several ranks; multiplied by a per-value-head gate, or by value-head
attention weights, each rank cuts its own heads out of its piece (no communication) instead of keeping the block
whole. q, k and v projected apart and joined by a cat for one short convolution (a linear-attention layer's) are a
split in segments whose key segments are in pieces."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpcompile
from tpcompile.ops import collectives as C


class GatedKeys(nn.Module):
    """2 key heads repeated over 4 value heads, scaled by a gate per value head (pointwise), scores with queries
    per value head, and a second product of the value-head weights with the repeated keys (matmul)."""

    def __init__(self, dim: int = 32, k_heads: int = 2, v_heads: int = 4, head_dim: int = 8) -> None:
        super().__init__()
        self.kh, self.vh, self.hd = k_heads, v_heads, head_dim
        self.q = nn.Linear(dim, v_heads * head_dim, bias=False)
        self.k = nn.Linear(dim, k_heads * head_dim, bias=False)
        self.v = nn.Linear(dim, v_heads * head_dim, bias=False)
        self.gate = nn.Linear(dim, v_heads, bias=False)
        self.o = nn.Linear(v_heads * head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.vh, self.hd).transpose(1, 2)
        k = self.k(x).view(b, t, self.kh, self.hd).transpose(1, 2)  # repeated as transformers' repeat_kv does
        k = k[:, :, None].expand(b, self.kh, self.vh // self.kh, t, self.hd).reshape(b, self.vh, t, self.hd)
        v = self.v(x).view(b, t, self.vh, self.hd).transpose(1, 2)
        g = torch.sigmoid(self.gate(x)).transpose(1, 2)[..., None]  # (b, v heads, t, 1)
        w = torch.softmax(q @ (k * g).transpose(-1, -2) / self.hd ** 0.5, -1)  # pointwise: pieces x even
        o = w @ v + (w @ k) * 0.5  # matmul: even weights @ keys in pieces
        return self.o(o.transpose(1, 2).reshape(b, t, -1))


class JoinedConv(nn.Module):
    """q, k (2 heads) and v (4 heads) projected apart, joined for one depthwise causal convolution, split again; the
    keys, repeated over the value heads, scaled by a gate per value head."""

    def __init__(self, dim: int = 32, k_heads: int = 2, v_heads: int = 4, head_dim: int = 8) -> None:
        super().__init__()
        self.kh, self.vh, self.hd = k_heads, v_heads, head_dim
        self.q = nn.Linear(dim, k_heads * head_dim, bias=False)
        self.k = nn.Linear(dim, k_heads * head_dim, bias=False)
        self.v = nn.Linear(dim, v_heads * head_dim, bias=False)
        channels = (2 * k_heads + v_heads) * head_dim
        self.conv = nn.Conv1d(channels, channels, 3, groups=channels, padding=2, bias=False)
        self.beta = nn.Linear(dim, v_heads, bias=False)
        self.o = nn.Linear(v_heads * head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        mixed = torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1).transpose(1, 2)
        mixed = F.silu(F.conv1d(mixed, self.conv.weight.squeeze(1).unsqueeze(1), padding=2,
                                groups=mixed.shape[1])[..., :t]).transpose(1, 2)
        q, k, v = mixed.split([self.kh * self.hd, self.kh * self.hd, self.vh * self.hd], dim=-1)
        q, k = (z.reshape(b, t, self.kh, self.hd).repeat_interleave(self.vh // self.kh, dim=2) for z in (q, k))
        beta = torch.sigmoid(self.beta(x))[..., None]  # a gate per value head, split evenly
        k, v = k * beta, v.reshape(b, t, self.vh, self.hd) * beta  # keys (and values) in pieces x the even gate
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        o = torch.softmax(q @ k.transpose(-1, -2) / self.hd ** 0.5, -1) @ v
        return self.o(o.transpose(1, 2).reshape(b, t, -1))


def _check(model: nn.Module, ws: int, dim: int = 32) -> tpcompile.ShardedModel:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sm = tpcompile.shard(model, ws, example_inputs=(torch.randn(2, 6, dim),))
    assert [str(w.message) for w in caught if issubclass(w.category, tpcompile.TPCompileWarning)] == []
    x = torch.randn(3, 9, dim)
    with torch.no_grad(), C.record() as events:
        ref = model(x)
        for out in tpcompile.simulate(sm, x):
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    assert [e.op for e in events if e.rank == 0 and e.phase == "forward"] == ["all_reduce"]  # the output projection
    report = tpcompile.check_gradients(model, sm, torch.randn(2, 7, dim))
    assert report.ok, str(report)
    return sm


@pytest.mark.parametrize("ws", [2, 4])
def test_keys_in_pieces_are_cut_to_the_value_heads(ws: int) -> None:
    torch.manual_seed(0)
    sm = _check(GatedKeys().eval(), ws)
    assert {m: sm.plan.modules[m] for m in ("q", "k", "v", "gate", "o")} == \
        {"q": "column", "k": "column", "v": "column", "gate": "column", "o": "row"}
    assert sm.plan.parameters["k.weight"].local_shape == (16 // min(ws, 2), 32)  # a key head, shared at 4 ranks
    assert sm.plan.parameters["gate.weight"].local_shape == (4 // ws, 32)


@pytest.mark.parametrize("ws", [2, 4])
def test_cat_of_projections_with_key_pieces_is_one_segmented_split(ws: int) -> None:
    torch.manual_seed(0)
    sm = _check(JoinedConv().eval(), ws)
    assert {m: sm.plan.modules[m] for m in ("q", "k", "v", "beta", "o")} == \
        {"q": "column", "k": "column", "v": "column", "beta": "column", "o": "row"}
    # q and k: a head each over 2 ranks at 4 ranks; v a head a rank (each projection's head size is found through
    # the cat and the convolution, so the key heads' pieces do not regroup v's heads)
    local = 2 * 16 // min(ws, 2) + 32 // ws
    assert sm.plan.parameters["conv.weight"].local_shape == (local, 1, 3)
