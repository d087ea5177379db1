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


@pytest.mark.parametrize("ws", [2, 4])
def test_depthwise_conv_over_shared_key_pieces(ws: int) -> None:
    torch.manual_seed(0)
    model = ShortConvHeads().eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sm = tpcompile.shard(model, ws, example_inputs=(torch.randn(2, 6, 32),))
    assert [str(w.message) for w in caught if issubclass(w.category, tpcompile.TPCompileWarning)] == []
    # q and k: 2 heads of 8 channels each over ws ranks (pieces of a head's group when ws > 2); v: 32 / ws
    local = 2 * 16 // min(ws, 2) + 32 // ws
    assert sm.plan.parameters["conv.weight"].local_shape == (local, 1, 4)
    assert sm.plan.parameters["in_proj.weight"].local_shape == (local, 32)
    x = torch.randn(3, 9, 32)
    with torch.no_grad():
        ref = model(x)
        for out in tpcompile.simulate(sm, x):
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    report = tpcompile.check_gradients(model, sm, torch.randn(2, 7, 32))
    assert report.ok, str(report)
