"""A cache written through a view (`cache[:B]`, fewer rows than allocated) is split by heads like the cache itself."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

import tpcompile


class RowsOfCache(nn.Module):
    """Attention whose static cache (max batch, kv heads, max length, head dim) is written for the first B rows."""

    def __init__(self, width: int = 32, heads: int = 4, kv_heads: int = 4, max_len: int = 12,
                 max_batch: int = 3) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, width // heads
        self.q, self.o = nn.Linear(width, width), nn.Linear(width, width)
        self.k, self.v = nn.Linear(width, kv_heads * self.hd), nn.Linear(width, kv_heads * self.hd)
        self.register_buffer("kc", torch.zeros(max_batch, kv_heads, max_len, self.hd))
        self.register_buffer("vc", torch.zeros(max_batch, kv_heads, max_len, self.hd))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.heads, self.hd).transpose(1, 2)
        k, v = (p(x).view(B, T, self.kv_heads, self.hd).transpose(1, 2) for p in (self.k, self.v))
        kc, vc = self.kc[:B], self.vc[:B]
        kc.index_copy_(2, pos, k)
        vc.index_copy_(2, pos, v)
        mask = (torch.arange(kc.shape[2]) <= pos[-1])[None, None, None, :]
        n = self.heads // self.kv_heads  # each kv head serves n query heads (Hugging Face's repeat_kv)
        kc, vc = (c[:, :, None].expand(B, self.kv_heads, n, *c.shape[2:]).reshape(B, self.heads, *c.shape[2:])
                  for c in (kc, vc))
        y = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


def test_cache_view_written_per_row_is_split_by_heads_and_decodes_exactly() -> None:
    """Ranks hold their kv heads of a cache written through cache[:B] (2 kv heads at 4 ranks: shared pieces);
    a prompt and three decode steps equal the original."""
    for ws, kv_heads, held in ((2, 4, 2), (4, 2, 1)):
        torch.manual_seed(0)
        model, reference = RowsOfCache(kv_heads=kv_heads).eval(), RowsOfCache(kv_heads=kv_heads).eval()
        reference.load_state_dict(model.state_dict())
        b, t = Dim("b", min=1, max=3), Dim("t", min=1, max=12)
        sm = tpcompile.shard(model, ws, example_inputs=(torch.randn(2, 3, 32), torch.arange(3)),
                             dynamic_shapes=({0: b, 1: t}, {0: t}))
        assert sm.plan.modules == {"q": "column", "k": "column", "v": "column", "o": "row"}
        ranks = [sm.rank(r) for r in range(ws)]
        assert ranks[0].kc.shape == (3, held, 12, 8)
        steps = [(torch.randn(1, 4, 32), torch.arange(4))] + [(torch.randn(1, 1, 32), torch.tensor([4 + i]))
                                                              for i in range(3)]
        for x, pos in steps:
            with torch.no_grad():
                want = reference(x, pos)
                outs = tpcompile.simulate_ranks(ws, lambda r: ranks[r](x, pos))
            for out in outs:
                torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
