"""Idioms of the Hugging Face architectures in tests/hf_models.py, each in a small model of its own: attention
keys assembled in a fresh tensor from split heads and a part shared by all heads (DeepSeek's multi-head latent
attention: `k.new_empty(...)`, then `copy_` into slices of it); one layer's weights applied twice behind a
projection into the residual stream (ALBERT); a fused multi-query projection viewed as heads and cut along
them by a slice and constant picks, its one key head broadcast by attention (Falcon); two convolutions split by
channels, column then row (Whisper's encoder stem).

Each model shards at world sizes 2 and 4 without a warning, every rank equals the original on another batch
and length, and each rank holds the part of the parameters the split gives.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from hf_models import held_share
from torch import nn

import tpcompile

D, H, HD, SHARED, LATENT = 32, 4, 8, 4, 8


class FilledKeys(nn.Module):
    """Multi-head latent attention in small: a narrow projection (kept whole) gives a latent and a key part
    every head shares; the latent widens to 4 heads of keys and values. Keys are built as
    `k.new_empty(B, H, T, HD + SHARED)`, their first HD features copied from the split heads, the last SHARED
    from the shared part expanded over the heads."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(D, H * (HD + SHARED), bias=False)
        self.kv_a = nn.Linear(D, LATENT + SHARED, bias=False)
        self.kv_b = nn.Linear(LATENT, H * 2 * HD, bias=False)
        self.o = nn.Linear(H * HD, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q(x).view(B, T, H, HD + SHARED).transpose(1, 2)
        latent, rot = torch.split(self.kv_a(x), [LATENT, SHARED], dim=-1)
        kv = self.kv_b(F.rms_norm(latent, (LATENT,))).view(B, T, H, 2 * HD).transpose(1, 2)
        k, v = torch.split(kv, [HD, HD], dim=-1)
        rot = rot.view(B, 1, T, SHARED).expand(-1, H, -1, -1)
        keys = kv.new_empty(*kv.shape[:-1], HD + SHARED)
        keys[..., :HD].copy_(k)
        keys[..., HD:].copy_(rot)
        out = F.scaled_dot_product_attention(q, keys, v, is_causal=True)
        return x + self.o(out.transpose(1, 2).reshape(B, T, H * HD))


def _shard(model: nn.Module, ws: int, example: torch.Tensor) -> tpcompile.ShardedModel:
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpcompile.TPCompileWarning)  # every split dim divides: no warning
        return tpcompile.shard(model, ws, example_inputs=(example,))


@pytest.mark.parametrize("ws", [2, 4])
def test_keys_filled_into_a_fresh_tensor_stay_split(ws: int) -> None:
    """new_empty sized from split heads is split like them; the shared part is copied in as each rank's heads."""
    torch.manual_seed(0)
    model = FilledKeys().eval()
    sm = _shard(model, ws, torch.randn(2, 8, D))
    roles = {m: sm.plan.modules[m] for m in ("q", "kv_a", "kv_b", "o")}
    assert roles == {"q": "column", "kv_a": "replicated", "kv_b": "column", "o": "row"}
    split, whole = D * H * (HD + SHARED) + LATENT * H * 2 * HD + H * HD * D, D * (LATENT + SHARED)
    assert held_share(model, sm) == pytest.approx((split / ws + whole) / (split + whole))
    x = torch.randn(3, 11, D)
    with torch.no_grad():
        ref = model(x)
        for r, out in enumerate(tpcompile.simulate(sm, x)):
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=0, msg=lambda m: f"rank {r}: {m}")


class Layer(nn.Module):
    """Post-norm transformer layer of 4 heads of 8 (BERT / ALBERT)."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (f(x).view(B, T, 4, C // 4).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, C)
        x = self.ln1(x + self.o(a))
        return self.ln2(x + self.down(F.gelu(self.up(x))))


class SharedLayers(nn.Module):
    """A projection into the residual stream, then one layer applied twice (ALBERT's shared weights); the
    stream comes from token embeddings (`tokens=True`) or from a float input."""

    def __init__(self, *, tokens: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16) if tokens else None
        self.norm = nn.LayerNorm(16)
        self.proj = nn.Linear(16, 32)
        self.layer = Layer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.norm(self.embed(x) if self.embed is not None else x))
        return self.layer(self.layer(h))


@pytest.mark.parametrize("ws", [2, 4])
def test_embedding_projection_is_whole_and_the_shared_layer_split(ws: int) -> None:
    """The projection of the embeddings is whole by design (a note, no warning); the layer applied twice is
    split once, q/k/v and up by columns, o and down by rows."""
    torch.manual_seed(0)
    model = SharedLayers(tokens=True).eval()
    sm = _shard(model, ws, torch.randint(0, 64, (2, 8)))
    assert sm.plan.modules["proj"] == "replicated"
    assert sm.plan.replicated["proj"].startswith("embedding projection: whole on every rank"), sm.plan.replicated
    roles = {m: sm.plan.modules[f"layer.{m}"] for m in ("q", "k", "v", "o", "up", "down")}
    assert roles == {"q": "column", "k": "column", "v": "column", "o": "row", "up": "column", "down": "row"}
    x = torch.randint(0, 64, (3, 11))
    with torch.no_grad():
        ref = model(x)
        for r, out in enumerate(tpcompile.simulate(sm, x)):
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=0, msg=lambda m: f"rank {r}: {m}")


@pytest.mark.parametrize("ws", [2, 4])
def test_shared_layer_stays_split_when_its_first_input_was_split(ws: int) -> None:
    """A float input's projection is column split in the first round and blamed at the first norm (warned);
    the shared layer, first reached while the stream was split, is not replicated with it."""
    torch.manual_seed(0)
    model = SharedLayers(tokens=False).eval()
    with pytest.warns(tpcompile.TPCompileWarning) as rec:
        sm = tpcompile.shard(model, ws, example_inputs=(torch.randn(2, 8, 16),))
    text = [str(w.message) for w in rec if issubclass(w.category, tpcompile.TPCompileWarning)]
    assert len(text) == 1 and "replicating proj " in text[0], text
    roles = {m: sm.plan.modules[f"layer.{m}"] for m in ("q", "k", "v", "o", "up", "down")}
    assert roles == {"q": "column", "k": "column", "v": "column", "o": "row", "up": "column", "down": "row"}
    x = torch.randn(3, 11, 16)
    with torch.no_grad():
        ref = model(x)
        for r, out in enumerate(tpcompile.simulate(sm, x)):
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=0, msg=lambda m: f"rank {r}: {m}")


class MultiQuery(nn.Module):
    """Falcon-7B's attention: one fused projection to 8 query heads and one key and one value head of 8,
    viewed as (B, T, 10, 8), cut by `[..., :-2, :]`, `[..., [-2], :]` and `[..., [-1], :]` (or, with `split`, as
    transformers 5.25 writes it, by `split([8, 1, 1], dim=-2)`); attention broadcasts the one key / value head over
    the query heads."""

    def __init__(self, split: bool = False) -> None:
        super().__init__()
        self.split = split
        self.qkv = nn.Linear(64, 64 + 2 * 8, bias=False)
        self.o = nn.Linear(64, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        fused = self.qkv(x).view(B, T, 10, 8)
        if self.split:
            q, k, v = fused.split([8, 1, 1], dim=-2)
        else:
            q, k, v = fused[..., :-2, :], fused[..., [-2], :], fused[..., [-1], :]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(out.transpose(1, 2).reshape(B, T, 64))


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("split", [False, True])
def test_multi_query_heads_cut_from_a_viewed_projection(ws: int, split: bool) -> None:
    """The fused projection is split by segments: the query heads across ranks, the key and value head whole
    on every rank; no warning, and each rank holds 64/ws query rows plus the 16 key and value rows."""
    torch.manual_seed(0)
    model = MultiQuery(split).eval()
    sm = _shard(model, ws, torch.randn(2, 8, 64))
    p = sm.plan.parameters["qkv.weight"]
    assert (p.role, p.segments, p.local_shape) == ("column", (64, 8, 8), (64 // ws + 16, 64))
    assert sm.plan.modules["o"] == "row"
    x = torch.randn(3, 11, 64)
    with torch.no_grad():
        ref = model(x)
        for r, out in enumerate(tpcompile.simulate(sm, x)):
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=0, msg=lambda m: f"rank {r}: {m}")


class ConvStem(nn.Module):
    """Whisper's encoder stem: conv1d (8 -> 32 channels) -> GELU -> conv1d (32 -> 32, stride 2) -> GELU, then
    the channels become features of a linear layer; `bias=False` leaves the second convolution's sum pending."""

    def __init__(self, *, bias: bool = True) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(8, 32, 3, padding=1)
        self.conv2 = nn.Conv1d(32, 32, 3, stride=2, padding=1, bias=bias)
        self.out = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.conv2(F.gelu(self.conv1(x))))
        return self.out(h.transpose(1, 2))


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("bias", [True, False])
def test_convolutions_split_by_channels(ws: int, bias: bool) -> None:
    """The first convolution is a column split by output channels, the second a row split by input channels
    (one all-reduce, the bias added once after it); every rank equals the original on another input size."""
    torch.manual_seed(0)
    model = ConvStem(bias=bias).eval()
    sm = _shard(model, ws, torch.randn(2, 8, 12))
    assert {m: sm.plan.modules[m] for m in ("conv1", "conv2")} == {"conv1": "column", "conv2": "row"}
    assert sm.plan.parameters["conv1.weight"].local_shape[0] == 32 // ws
    assert sm.plan.parameters["conv2.weight"].local_shape[1] == 32 // ws
    assert [op for op, _ in sm.collectives()].count("all_reduce") == 1
    x = torch.randn(3, 8, 17)
    with torch.no_grad():
        ref = model(x)
        for r, out in enumerate(tpcompile.simulate(sm, x)):
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=0, msg=lambda m: f"rank {r}: {m}")
