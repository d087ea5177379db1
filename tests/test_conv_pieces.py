"""A depthwise convolution over fused q|k|v channels whose key heads are fewer than the ranks (gated delta
attention's short convolution): the q and k channels are pieces shared by groups of ranks, the v channels split
over all of them; each rank convolves its channels with its cut of the kernel, whose gradient is summed over the
ranks that share a piece."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpcompile


class ShortConvHeads(nn.Module):
    """in_proj -> causal depthwise conv over q|k|v -> silu -> grouped-value attention per head -> out."""

    def __init__(self, dim: int = 32, k_heads: int = 2, v_heads: int = 4, head_dim: int = 8) -> None:
        super().__init__()
        self.kh, self.vh, self.hd = k_heads, v_heads, head_dim
        channels = (2 * k_heads + v_heads) * head_dim
        self.in_proj = nn.Linear(dim, channels, bias=False)
        self.conv = nn.Conv1d(channels, channels, 4, groups=channels, padding=3, bias=False)
        self.out = nn.Linear(v_heads * head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        mixed = F.silu(self.conv(self.in_proj(x).transpose(1, 2))[..., :t]).transpose(1, 2)
        q, k, v = mixed.split([self.kh * self.hd, self.kh * self.hd, self.vh * self.hd], dim=-1)
        q, k = (z.reshape(b, t, self.kh, self.hd).repeat_interleave(self.vh // self.kh, dim=2) for z in (q, k))
        v = v.reshape(b, t, self.vh, self.hd)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        o = torch.softmax(q @ k.transpose(-1, -2) / self.hd ** 0.5, -1) @ v
        return self.out(o.transpose(1, 2).reshape(b, t, -1))


def _shard_quietly(model: nn.Module, ws: int, example: torch.Tensor) -> tpcompile.ShardedModel:
    """`shard`, asserting it warns of nothing."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sm = tpcompile.shard(model, ws, example_inputs=(example,))
    assert [str(w.message) for w in caught if issubclass(w.category, tpcompile.TPCompileWarning)] == []
    return sm


def _equal_with_gradients(model: nn.Module, sm: tpcompile.ShardedModel, x: torch.Tensor, grad_x: torch.Tensor) -> None:
    """Every rank's output equal to the original's on `x`; gradients equal on `grad_x`."""
    with torch.no_grad():
        ref = model(x)
        for out in tpcompile.simulate(sm, x):
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    report = tpcompile.check_gradients(model, sm, grad_x)
    assert report.ok, str(report)


@pytest.mark.parametrize("ws", [2, 4])
def test_depthwise_conv_over_shared_key_pieces(ws: int) -> None:
    torch.manual_seed(0)
    model = ShortConvHeads().eval()
    sm = _shard_quietly(model, ws, torch.randn(2, 6, 32))
    # q and k: 2 heads of 8 channels each over ws ranks (pieces of a head's group when ws > 2); v: 32 / ws
    local = 2 * 16 // min(ws, 2) + 32 // ws
    assert sm.plan.parameters["conv.weight"].local_shape == (local, 1, 4)
    assert sm.plan.parameters["in_proj.weight"].local_shape == (local, 32)
    _equal_with_gradients(model, sm, torch.randn(3, 9, 32), torch.randn(2, 7, 32))


class ConvKeysRelBias(nn.Module):
    """Separate k and v projections of 2 kv heads, each through its own depthwise causal convolution (channels in
    pieces at 4 ranks), and a relative-position bias mixed per head from the hidden states: `states @ P` with P a
    parameter read whole, the states split by heads; the bias gathered by distance and masked."""

    def __init__(self, dim: int = 32, heads: int = 4, kv_heads: int = 2, head_dim: int = 8, rel: int = 4,
                 extent: int = 6) -> None:
        super().__init__()
        self.h, self.kvh, self.hd, self.extent = heads, kv_heads, head_dim, extent
        self.q = nn.Linear(dim, heads * head_dim, bias=False)
        self.k = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.v = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.r = nn.Linear(dim, heads * rel, bias=False)
        self.k_conv = nn.Conv1d(kv_heads * head_dim, kv_heads * head_dim, 3, groups=kv_heads * head_dim, padding=2)
        self.v_conv = nn.Conv1d(kv_heads * head_dim, kv_heads * head_dim, 3, groups=kv_heads * head_dim, padding=2)
        self.profiles = nn.Parameter(torch.randn(rel, extent) / rel)
        self.o = nn.Linear(heads * head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        k = self.k_conv(self.k(x).transpose(1, 2))[..., :t].transpose(1, 2)
        v = self.v_conv(self.v(x).transpose(1, 2))[..., :t].transpose(1, 2)
        q = self.q(x).view(b, t, self.h, self.hd).transpose(1, 2)
        k, v = (z.reshape(b, t, self.kvh, self.hd).transpose(1, 2).repeat_interleave(self.h // self.kvh, dim=1)
                for z in (k, v))
        logits = (self.r(x).view(b, t, self.h, -1) @ self.profiles).transpose(1, 2)  # (b, h, t, extent)
        pos = torch.arange(t)
        distance = (pos[:, None] - pos[None, :])[None, None]
        bias = logits.gather(-1, distance.clamp(0, self.extent - 1).expand(b, self.h, -1, -1))
        bias = bias.masked_fill((distance < 0) | (distance >= self.extent), 0.0)
        scores = q @ k.transpose(-1, -2) / self.hd ** 0.5 + bias
        o = torch.softmax(scores, -1) @ v
        return self.o(o.transpose(1, 2).reshape(b, t, -1))


@pytest.mark.parametrize("ws", [2, 4])
def test_conv_over_kv_pieces_and_a_whole_weight_on_split_heads(ws: int) -> None:
    """At 4 ranks the k and v channels are 2 pieces each shared by 2 ranks: each convolution's kernel and bias
    are cut alike and their gradients summed over the sharing ranks; `states @ P` keeps P whole, applied to the
    rank's heads, its gradient summed over the ranks. No warning, every projection split, one forward
    all-reduce."""
    torch.manual_seed(0)
    model = ConvKeysRelBias().eval()
    sm = _shard_quietly(model, ws, torch.randn(2, 7, 32))
    assert {m: sm.plan.modules[m] for m in ("q", "k", "v", "r", "o")} == \
        {"q": "column", "k": "column", "v": "column", "r": "column", "o": "row"}
    assert sm.plan.parameters["k_conv.weight"].local_shape == (16 // min(ws, 2), 1, 3)
    assert sm.plan.parameters["profiles"].local_shape == (4, 6)
    assert [op for op, _ in sm.collectives()] == ["all_reduce"]
    _equal_with_gradients(model, sm, torch.randn(3, 9, 32), torch.randn(2, 8, 32))


class ResidualShortConv(nn.Module):
    """Blocks whose residual stream goes through a depthwise short convolution (`h + conv(h)`) before an RMS
    norm and an MLP; the windows of a second short convolution written out with unfold."""

    def __init__(self, dim: int = 16, hidden: int = 32, width: int = 3) -> None:
        super().__init__()
        self.width = width
        self.conv = nn.Conv1d(dim, dim, width, groups=dim, padding=width - 1, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.taps = nn.Parameter(torch.randn(hidden, width) / width)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        t = h.shape[1]
        h = h + self.conv(h.transpose(1, 2))[..., :t].transpose(1, 2)
        z = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        u = F.pad(self.up(z).transpose(1, 2), (self.width - 1, 0))  # (b, hidden, t + width - 1)
        u = (u.unfold(-1, self.width, 1) * self.taps[:, None, :]).sum(-1)  # causal conv over the windows
        return h + self.down(F.silu(u).transpose(1, 2))


@pytest.mark.parametrize("ws", [2, 4])
def test_depthwise_conv_on_the_residual_stream_is_kept_whole_without_a_warning(ws: int) -> None:
    """The stream's convolution would be a column split of a whole input that the norm then reads whole: it is
    kept whole as a choice (shown in the plan, no warning); the MLP splits through the unfolded windows."""
    torch.manual_seed(0)
    model = ResidualShortConv().eval()
    sm = _shard_quietly(model, ws, torch.randn(2, 6, 16))
    assert {m: sm.plan.modules[m] for m in ("conv", "up", "down")} == \
        {"conv": "replicated", "up": "column", "down": "row"}
    assert any("depthwise convolution fed a whole input is kept whole" in why for why in sm.plan.replicated.values())
    assert sm.plan.parameters["taps"].local_shape == (32 // ws, 3)
    _equal_with_gradients(model, sm, torch.randn(3, 9, 16), torch.randn(2, 8, 16))


class HeadConvQK(nn.Module):
    """q and k projected apart (4 query heads, `kv_heads` key heads), joined for one causal convolution grouped by
    head (one group of `head_dim` channels per head: it mixes channels within a head, across time), split again
    and added to the projections (a residual per head, as compressed convolutional attention has) for
    grouped-query attention."""

    def __init__(self, dim: int = 32, heads: int = 4, kv_heads: int = 2, head_dim: int = 8) -> None:
        super().__init__()
        self.h, self.kvh, self.hd = heads, kv_heads, head_dim
        channels = (heads + kv_heads) * head_dim
        self.q = nn.Linear(dim, heads * head_dim, bias=False)
        self.k = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.v = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.conv = nn.Conv1d(channels, channels, 2, groups=heads + kv_heads, padding=1)
        self.o = nn.Linear(heads * head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k = self.q(x).view(b, t, self.h, self.hd), self.k(x).view(b, t, self.kvh, self.hd)
        qk = torch.cat([q.flatten(2), k.flatten(2)], dim=-1).transpose(1, 2)
        qk = self.conv(qk)[..., :t].transpose(1, 2)
        cq, ck = qk.split([self.h * self.hd, self.kvh * self.hd], dim=-1)
        q = (q + cq.view(b, t, self.h, self.hd)).transpose(1, 2)
        k, v = ((z.view(b, t, self.kvh, self.hd) + r).transpose(1, 2).repeat_interleave(self.h // self.kvh, dim=1)
                for z, r in ((ck, k), (self.v(x), 0)))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(o.transpose(1, 2).reshape(b, t, -1))


@pytest.mark.parametrize("ws", [2, 4])
def test_head_grouped_conv_over_query_heads_and_key_pieces(ws: int) -> None:
    """A convolution of one group per head over q|k: every rank's block of each segment is whole heads (at 4
    ranks the 2 key heads are pieces shared by 2 ranks), so each rank convolves its own heads with its cut of the
    kernel (the group count made local), the kernel's gradient summed over the ranks sharing a key head. No
    warning, every projection split, one forward all-reduce."""
    torch.manual_seed(0)
    model = HeadConvQK().eval()
    sm = _shard_quietly(model, ws, torch.randn(2, 7, 32))
    assert {m: sm.plan.modules[m] for m in ("q", "k", "v", "o")} == \
        {"q": "column", "k": "column", "v": "column", "o": "row"}
    local = 32 // ws + 16 // min(ws, 2)  # the rank's query heads and its key head(s), 8 channels each
    assert sm.plan.parameters["conv.weight"].local_shape == (local, 8, 2)
    assert sm.plan.parameters["conv.bias"].local_shape == (local,)
    assert [op for op, _ in sm.collectives()] == ["all_reduce"]
    _equal_with_gradients(model, sm, torch.randn(3, 9, 32), torch.randn(2, 8, 32))
