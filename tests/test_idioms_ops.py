"""Op-level idioms of real attention layers keep the heads split: interleaved and complex rotary embeddings,
ALiBi and relative-position biases added per head (BLOOM's baddbmm on batch x heads included), and grouped-query
attention by repeat_interleave, with fewer kv heads than ranks too.

Each model shards at world sizes 2 and 4 without a warning, every rank equals the original on another
batch and length, and each rank holds the fraction of the parameters the split gives.
"""
from __future__ import annotations

import copy
import math
import warnings
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpcompile
from tpcompile.api import shard_captured
from tpcompile.capture import capture

D, BLOCK = 64, 32


class Attention(nn.Module):
    """Causal attention over 4 heads of 16 with one position idiom; `kv_heads` < 4 repeats kv heads."""

    def __init__(self, *, rope: str = "none", bias: str = "none", kv_heads: int = 4, heads: int = 4) -> None:
        super().__init__()
        self.h, self.kv, self.hd = heads, kv_heads, D // heads
        self.q, self.o = nn.Linear(D, D, bias=False), nn.Linear(D, D, bias=False)
        self.k, self.v = nn.Linear(D, kv_heads * self.hd, bias=False), nn.Linear(D, kv_heads * self.hd, bias=False)
        self.rope, self.bias = rope, bias
        inv = 1.0 / 10000.0 ** (torch.arange(0, self.hd, 2).float() / self.hd)
        angles = torch.outer(torch.arange(BLOCK).float(), inv)  # (BLOCK, hd/2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        self.register_buffer("freqs", torch.polar(torch.ones_like(angles), angles), persistent=False)
        self.register_buffer("slopes", torch.tensor([2 ** (-8 * (i + 1) / heads) for i in range(heads)]),
                             persistent=False)
        self.register_buffer("mask", torch.tril(torch.ones(BLOCK, BLOCK, dtype=torch.bool)), persistent=False)
        self.rel = nn.Embedding(2 * BLOCK, heads) if bias == "relative" else None

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of (B, T, heads, hd): pairs (2i, 2i+1) rotated, as stack/flatten or complex numbers."""
        T = x.shape[1]
        if self.rope == "interleaved":  # GPT-J / Llama-reference style
            cos, sin = self.cos[:T, None, :], self.sin[:T, None, :]
            x1, x2 = x[..., ::2], x[..., 1::2]
            return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)
        if self.rope == "complex":  # Meta's Llama: view_as_complex / view_as_real
            xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
            return torch.view_as_real(xc * self.freqs[:T, None, :]).flatten(3).type_as(x)
        return x

    def scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """(B, heads, T, T) attention logits with the position bias of `self.bias`."""
        B, _, T, _ = q.shape
        pos = torch.arange(T, device=q.device)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(self.hd)
        if self.bias == "alibi":  # MPT / Falcon: slope * key position, a (1, heads, 1, T) bias
            att = att + (self.slopes[:, None] * pos[None, :])[None, :, None, :]
        elif self.bias == "relative":  # T5: a learned bias per head and distance
            distance = (pos[None, :] - pos[:, None]).clamp(-BLOCK + 1, BLOCK - 1) + BLOCK
            att = att + self.rel(distance).permute(2, 0, 1)[None]
        return att

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.rotate(self.q(x).view(B, T, self.h, self.hd)).transpose(1, 2)
        k = self.rotate(self.k(x).view(B, T, self.kv, self.hd)).transpose(1, 2)
        v = self.v(x).view(B, T, self.kv, self.hd).transpose(1, 2)
        if self.kv != self.h:  # grouped-query attention: each kv head serves h / kv query heads
            k, v = k.repeat_interleave(self.h // self.kv, dim=1), v.repeat_interleave(self.h // self.kv, dim=1)
        if self.bias == "alibi_baddbmm":  # BLOOM: heads folded into the batch, the bias added by baddbmm
            qf, kf, vf = (t.reshape(B * self.h, T, self.hd) for t in (q, k, v))
            pos = torch.arange(T, device=x.device)
            alibi = (self.slopes[:, None] * pos[None, :]).expand(B, self.h, T).reshape(B * self.h, 1, T)
            att = torch.baddbmm(alibi, qf, kf.transpose(1, 2), beta=1.0, alpha=1 / math.sqrt(self.hd))
            att = att.masked_fill(~self.mask[:T, :T], float("-inf")).softmax(-1)
            y = torch.bmm(att, vf).view(B, self.h, T, self.hd)
        elif self.bias != "none":
            att = self.scores(q, k).masked_fill(~self.mask[:T, :T], float("-inf")).softmax(-1)
            y = att @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(B, T, D))


IDIOMS = {
    "interleaved_rotary": dict(rope="interleaved"),
    "complex_rotary": dict(rope="complex"),
    "alibi_bias": dict(bias="alibi"),
    "alibi_baddbmm": dict(bias="alibi_baddbmm"),
    "relative_bias": dict(bias="relative"),
    "gqa_repeat_interleave": dict(kv_heads=2),
    "gqa_rotary": dict(kv_heads=2, rope="interleaved"),
    "gqa_complex_rotary": dict(kv_heads=2, rope="complex"),  # view_as_complex of kv heads in pieces (DTensor's rule)
}


def _expected_held(model: Attention, ws: int) -> float:
    """q and o split over every rank, k and v over min(ws, kv heads) pieces, the relative bias table whole."""
    split = lambda m, n: m.weight.numel() / n  # noqa: E731
    held = split(model.q, ws) + split(model.o, ws) + 2 * split(model.k, min(ws, model.kv))
    held += 0 if model.rel is None else model.rel.weight.numel()
    return held / sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", list(IDIOMS))
def test_idiom_keeps_heads_split(name: str) -> None:
    """Every projection split (k/v in pieces when kv heads are fewer than ranks), no warning, ranks exact."""
    torch.manual_seed(0)
    model = Attention(**IDIOMS[name]).eval()
    cap = capture(model, (torch.randn(2, 8, D),))
    x = torch.randn(3, 12, D)
    with torch.no_grad():
        ref = model(x)
    for ws in (2, 4):
        with warnings.catch_warnings():
            warnings.simplefilter("error", tpcompile.TPCompileWarning)
            warnings.simplefilter("ignore", FutureWarning)  # deepcopy of torch's pytree spec
            sm = shard_captured(replace(cap, gm=copy.deepcopy(cap.gm)), ws)
        assert {m: r for m, r in sm.plan.modules.items() if m != "rel"} == \
            {"q": "column", "k": "column", "v": "column", "o": "row"}
        held = sum(p.numel() for p in sm.rank(0).parameters()) / sum(p.numel() for p in model.parameters())
        assert held == pytest.approx(_expected_held(model, ws))
        assert [c for c, _ in sm.collectives()] == ["all_reduce"]
        with torch.no_grad():
            for out in tpcompile.simulate(sm, x):
                torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


def test_kv_heads_in_pieces_train_like_the_original() -> None:
    """GQA with 2 kv heads at 4 ranks: the gradients of the kv pieces, summed over the ranks sharing them, are exact."""
    torch.manual_seed(0)
    model = Attention(kv_heads=2, rope="interleaved").train()
    sm = tpcompile.shard(model, 4, example_inputs=(torch.randn(2, 8, D),))
    x = torch.randn(3, 6, D)
    model(x).pow(2).sum().backward()
    ranks = [sm.rank(r) for r in range(4)]

    def step(r: int) -> dict:
        ranks[r](x).pow(2).sum().backward()
        return {n: p.grad for n, p in ranks[r].named_parameters()}
    for r, grads in enumerate(tpcompile.simulate_ranks(4, step)):
        kv = r // 2  # ranks 0-1 hold kv head 0, ranks 2-3 kv head 1
        torch.testing.assert_close(grads["k.weight"], model.k.weight.grad[kv * 16:(kv + 1) * 16], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(grads["q.weight"], model.q.weight.grad[r * 16:(r + 1) * 16], atol=1e-4, rtol=1e-4)
