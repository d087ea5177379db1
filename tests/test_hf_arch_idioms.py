"""Idioms of the Hugging Face architectures in tests/hf_models.py, each in a small model of its own: attention
keys assembled in a fresh tensor from split heads and a part shared by all heads (DeepSeek's multi-head latent
attention: `k.new_empty(...)`, then `copy_` into slices of it).

Each model shards at world sizes 2 and 4 without a warning, every rank equals the original on another batch
and length, and each rank holds the part of the parameters the split gives.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
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


def _held(model: nn.Module, sm: tpcompile.ShardedModel) -> float:
    """Share of the parameter elements one rank holds."""
    local = sum(math.prod(p.local_shape) for p in sm.plan.parameters.values())
    return local / sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("ws", [2, 4])
def test_keys_filled_into_a_fresh_tensor_stay_split(ws: int) -> None:
    """new_empty sized from split heads is split like them; the shared part is copied in as each rank's heads."""
    torch.manual_seed(0)
    model = FilledKeys().eval()
    sm = _shard(model, ws, torch.randn(2, 8, D))
    roles = {m: sm.plan.modules[m] for m in ("q", "kv_a", "kv_b", "o")}
    assert roles == {"q": "column", "kv_a": "replicated", "kv_b": "column", "o": "row"}
    split, whole = D * H * (HD + SHARED) + LATENT * H * 2 * HD + H * HD * D, D * (LATENT + SHARED)
    assert _held(model, sm) == pytest.approx((split / ws + whole) / (split + whole))
    x = torch.randn(3, 11, D)
    with torch.no_grad():
        ref = model(x)
        for r, out in enumerate(tpcompile.simulate(sm, x)):
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=0, msg=lambda m: f"rank {r}: {m}")
