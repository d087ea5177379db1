"""A fused projection whose parts are split again further on (Mamba-2's z | x|B|C | dt: x|B|C is convolved
depthwise, then split into x, B and C): the projection is cut by the finest parts, B and C of one group whole on
every rank (pieces shared by all of them, as multi-query's key and value), x, z and dt by heads. A multiplier
buffer laid over the fused parts is cut like them; B and C repeated per head with an `output_size`; the gate's
product viewed as one group for a norm, whose statistics are summed over the ranks."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpcompile
from tpcompile.ops import collectives as C


class Mamba2Like(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4, head_dim: int = 8, groups: int = 1, state: int = 4) -> None:
        super().__init__()
        self.h, self.d, self.g, self.n = heads, head_dim, groups, state
        inner, gs = heads * head_dim, groups * state
        self.sizes = [inner, inner + 2 * gs, heads]
        self.in_proj = nn.Linear(dim, sum(self.sizes), bias=False)
        self.conv = nn.Conv1d(inner + 2 * gs, inner + 2 * gs, 3, groups=inner + 2 * gs, padding=2)
        self.register_buffer("mult", torch.linspace(0.5, 1.5, sum(self.sizes))[None, None])
        self.norm_weight = nn.Parameter(torch.rand(inner) + 0.5)
        self.out = nn.Linear(inner, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        z, xbc, dt = (self.in_proj(x) * self.mult).split(self.sizes, dim=-1)
        xbc = F.silu(self.conv(xbc.transpose(1, 2))[..., :t].transpose(1, 2))
        xs, B, Cm = xbc.split([self.h * self.d, self.g * self.n, self.g * self.n], dim=-1)
        xs = xs.view(b, t, self.h, self.d)
        B, Cm = (v.view(b, t, self.g, self.n).repeat_interleave(self.h // self.g, dim=2, output_size=self.h)
                 for v in (B, Cm))
        states = torch.cumsum(F.softplus(dt)[..., None, None] * B[..., :, None] * xs[..., None, :], dim=1)
        y = (Cm[..., :, None] * states).sum(-2).reshape(b, t, -1) * F.silu(z)
        y = y.view(b, t, 1, -1)  # one group: a norm over all the inner features
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.out(y.view(b, t, -1) * self.norm_weight)


@pytest.mark.parametrize("ws", [2, 4])
def test_fused_parts_split_again_are_cut_by_the_finest(ws: int) -> None:
    torch.manual_seed(0)
    model = Mamba2Like().eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sm = tpcompile.shard(model, ws, example_inputs=(torch.randn(2, 6, 32),))
    assert [str(w.message) for w in caught if issubclass(w.category, tpcompile.TPCompileWarning)] == []
    pp = sm.plan.parameters["in_proj.weight"]
    assert pp.segments == (32, 32, 4, 4, 4) and pp.seg_pieces == (ws, ws, 1, 1, ws), pp
    assert pp.local_shape == (32 // ws * 2 + 8 + 4 // ws, 32)
    assert sm.plan.parameters["conv.weight"].local_shape == (32 // ws + 8, 1, 3)
    x = torch.randn(3, 9, 32)
    with torch.no_grad():
        ref = model(x)
        with C.record() as events:
            outs = tpcompile.simulate(sm, x)
    for out in outs:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    # the norm's statistics over the split features, then the output projection's sum
    assert [e.op for e in events if e.rank == 0 and e.phase == "forward"] == ["all_reduce", "all_reduce"]
    report = tpcompile.check_gradients(model, sm, torch.randn(2, 7, 32))
    assert report.ok, str(report)
