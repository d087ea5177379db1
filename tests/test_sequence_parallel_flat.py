"""Sequence parallelism for models that flatten tokens before a projection (GPT-2's Conv1D, OPT) and for vision
transformers: per block an all-gather into and a reduce-scatter out of each region, the original's numerics and
gradients; where tokens cannot be split, the plan says why.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpcompile
from tpcompile.passes.rank_module import local_tensor

sys.path.insert(0, str(Path(__file__).parent))
import hf_models  # noqa: E402


def _grads(model: nn.Module, kwargs: dict, out: str) -> dict:
    getattr(model(**kwargs), out).pow(2).mean().backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("name", ["gpt2", "opt"])
def test_flattened_tokens_are_reduce_scattered(name: str, ws: int) -> None:
    """GPT-2 (addmm on (B*T, C)) and OPT (reshape to (B*T, C) around the MLP): all-gather and reduce-scatter per
    region, no all-reduce; logits and every rank's gradients equal the original's on another batch and length."""
    arch = next(a for a in hf_models.ARCHS if a.name == name)
    model = hf_models.build(arch)
    sm = tpcompile.shard(model, ws, example_kwargs=hf_models.inputs(arch, 2, 8), sequence_parallel=True)
    ops = [op for op, _ in sm.collectives()]
    assert "all_reduce" not in ops and ops.count("reduce_scatter") == 5  # the embedding and 2 per block
    assert all(v.startswith("reduce-scattered") for v in sm.plan.sequence_parallel.values())
    kwargs = hf_models.inputs(arch, 3, 12)
    with torch.no_grad():
        ref = model(**kwargs).logits
        for out in tpcompile.simulate(sm, **kwargs):
            torch.testing.assert_close(out.logits, ref, atol=2e-5, rtol=1e-5)
    want = _grads(copy.deepcopy(model), kwargs, "logits")
    ranks = [sm.rank(r) for r in range(ws)]
    for r, got in enumerate(tpcompile.simulate_ranks(ws, lambda r: _grads(ranks[r], kwargs, "logits"))):
        for n, g in got.items():
            torch.testing.assert_close(g, local_tensor(want[n], sm.plan.parameters[n].slice(), r, ws),
                                       atol=1e-6, rtol=1e-4, msg=n)


class TinyViT(nn.Module):
    """Patches of a 16x16 image as 16 tokens (no class token), pre-norm blocks, mean-pooled features."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.patch = nn.Conv2d(3, d, 4, 4)
        self.pos = nn.Parameter(0.02 * torch.randn(16, d))
        self.norm1, self.norm2, self.norm = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        x = self.patch(img).flatten(2).transpose(1, 2) + self.pos  # (B, 16, d)
        B, N, D = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(B, N, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, D))
        x = x + self.out(F.gelu(self.fc(self.norm2(x))))
        return self.norm(x).mean(1)


@pytest.mark.parametrize("ws", [2, 4])
def test_vision_transformer_tokens_split(ws: int) -> None:
    """16 patch tokens split over the ranks: a reduce-scatter after each region (the patches enter the first one
    whole), an all-gather into the MLP, the mean pool from partial sums."""
    torch.manual_seed(0)
    model = TinyViT().eval()
    sm = tpcompile.shard(model, ws, example_inputs=(torch.randn(2, 3, 16, 16),), sequence_parallel=True)
    assert [op for op, _ in sm.collectives()] == ["reduce_scatter", "all_gather", "reduce_scatter", "all_reduce"]
    assert list(sm.plan.statistics) == ["aten.mean.dim (mean) at the top-level module"]
    img = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        for out in tpcompile.simulate(sm, img):
            torch.testing.assert_close(out, model(img), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("ws", [2, 3])
def test_class_token_count_splits_unevenly(ws: int) -> None:
    """A vision transformer with a class token has 17 tokens: at 2 and 3 ranks they split in shares of 9|8 and
    6|6|5, each row split reduce-scattered, and the hidden states equal the original's."""
    model = _vit()
    sm = tpcompile.shard(model, ws, example_kwargs={"pixel_values": torch.randn(2, 3, 32, 32)}, sequence_parallel=True)
    assert set(sm.plan.sequence_parallel.values()) == {"reduce-scattered: split by tokens"}
    pixels = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        want = model(pixel_values=pixels).last_hidden_state
        for out in tpcompile.simulate(sm, pixel_values=pixels):
            torch.testing.assert_close(out.last_hidden_state, want, atol=2e-5, rtol=1e-5)


def _vit() -> nn.Module:
    t = hf_models._tf()
    cfg = t.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                      image_size=32, patch_size=8)
    torch.manual_seed(0)
    return t.ViTModel(cfg, add_pooling_layer=False).eval()
