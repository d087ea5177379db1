"""Buffers written in place with a split value (a KV cache filled by index_copy_) are split with it."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import tpcompile


class CachedAttention(nn.Module):
    """One attention layer with a static KV cache (batch, heads, max length, head dim) written per step."""

    def __init__(self, width: int = 32, heads: int = 4, max_len: int = 16, batch: int = 2) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))
        self.heads, self.hd = heads, width // heads
        self.register_buffer("kc", torch.zeros(batch, heads, max_len, self.hd))
        self.register_buffer("vc", torch.zeros(batch, heads, max_len, self.hd))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, self.heads, self.hd).transpose(1, 2) for p in (self.q, self.k, self.v))
        self.kc.index_copy_(2, pos, k)
        self.vc.index_copy_(2, pos, v)
        mask = (torch.arange(self.kc.shape[2]) <= pos.max())[None, None, None, :]  # the positions written so far
        y = F.scaled_dot_product_attention(q, self.kc, self.vc, attn_mask=mask)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


def test_kv_cache_buffer_is_split_by_heads_and_decodes_exactly() -> None:
    """Each rank holds its heads of the cache (1/world_size of its bytes); six decode steps equal the original."""
    for ws in (2, 4):
        torch.manual_seed(0)
        model = CachedAttention().eval()
        reference = CachedAttention().eval()
        reference.load_state_dict(model.state_dict())
        sm = tpcompile.shard(model, ws, example_inputs=(torch.randn(2, 1, 32), torch.tensor([0])))
        assert sm.plan.modules == {"q": "column", "k": "column", "v": "column", "o": "row"}
        ranks = [sm.rank(r) for r in range(ws)]
        assert ranks[0].kc.shape == (2, 4 // ws, 16, 8) and ranks[0].vc.numel() == model.vc.numel() // ws
        for step in range(6):
            x, pos = torch.randn(2, 1, 32), torch.tensor([step])
            with torch.no_grad():
                want = reference(x, pos)
                outs = tpcompile.simulate_ranks(ws, lambda r: ranks[r](x, pos))
            for out in outs:
                torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
