"""Rules that keep a split through joins, gathers, tiling and depthwise convolutions: cat and its aliases, cat
along the split dim into segments, gather and repeat along other dims, a depthwise convolution over channels in
segments, and a fused projection's split sizes found past such a convolution. Each model shards without a warning,
every rank equals the original on a new batch, and (where the rule cuts something new) the gradients equal too."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from test_rules import _check
from torch import nn

import tpcompile


def _gradients_equal(model: nn.Module, sm: tpcompile.ShardedModel) -> None:
    report = tpcompile.check_gradients(model.train(), sm, torch.randn(2, 6, 32))
    assert report.ok, str(report)


class Joined(nn.Module):
    """Two column splits joined along the tokens by torch.cat or one of its aliases (kept as their own aten ops)."""

    def __init__(self, join: str) -> None:
        super().__init__()
        self.join = getattr(torch, join)
        self.up, self.gate, self.down = nn.Linear(32, 64), nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.join([self.up(x), self.gate(x)], dim=1)))


@pytest.mark.parametrize("join", ["cat", "concatenate", "concat"])
def test_cat_and_its_aliases_keep_the_split(join: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpcompile.TPCompileWarning)
        sm = _check(Joined(join).eval(), torch.randn(2, 5, 32))
    assert sm.plan.modules == {"up": "column", "gate": "column", "down": "row"}


class GatherTokens(nn.Module):
    """torch.gather along the tokens of a column split, with an index built whole (each token's predecessor) and
    one computed from the split value."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.up(x))
        b, t, f = h.shape
        prev = (torch.arange(t, device=x.device) - 1).clamp(min=0)
        ordered = torch.gather(h, 1, (h > 0).long())  # an index split as h is (token 0 or 1)
        return self.down(ordered + torch.gather(h, 1, prev.view(1, t, 1).expand(b, t, f)))




class RepeatedBatch(nn.Module):
    """A column split tiled along the batch and a new leading dim (x.repeat), then summed back."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.up(x)).repeat(3, 2, 1, 1)  # (3, 2B, T, F)
        return self.down(h.sum(0)[: x.shape[0]] + h.sum(0)[x.shape[0]:])


@pytest.mark.parametrize("ws", [2, 3])
@pytest.mark.parametrize("block", [GatherTokens, RepeatedBatch], ids=["gather", "repeat"])
def test_gather_and_repeat_along_other_dims_keep_the_split(block: type, ws: int) -> None:
    """At 3 ranks the 64 features are zero-padded to 66 (a layout the DTensor fallback does not take)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpcompile.TPCompileWarning)
        sm = _check(model := block().eval(), torch.randn(2, 5, 32), ws)
    assert sm.plan.modules == {"up": "column", "down": "row"}
    _gradients_equal(model, sm)


class JoinedForOneConv(nn.Module):
    """q, k and v projected apart, joined along their features for one depthwise convolution, then split again
    (the short convolution of gated linear-attention layers)."""

    def __init__(self, widths: tuple = (48, 48, 24)) -> None:
        super().__init__()
        self.widths = list(widths)
        self.q, self.k, self.v = (nn.Linear(32, w) for w in widths)
        self.conv = nn.Conv1d(sum(widths), sum(widths), 3, groups=sum(widths), padding=2)
        self.out_v, self.out_qk = nn.Linear(widths[2], 32), nn.Linear(widths[0], 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)
        qkv = F.silu(self.conv(qkv.transpose(1, 2))[..., : x.shape[1]]).transpose(1, 2)
        q, k, v = torch.split(qkv, self.widths, dim=-1)
        return self.out_v(v) + self.out_qk(q * k)


@pytest.mark.parametrize("ws", [2, 3, 5])
def test_cat_along_the_split_dim_joins_into_segments(ws: int) -> None:
    """Each rank joins its blocks (q[r] | k[r] | v[r]) and convolves them with its cut of the kernels; at 5 ranks
    each projection is zero-padded (48 -> 50, 24 -> 25) and the joined value keeps each padding."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpcompile.TPCompileWarning)
        sm = _check(model := JoinedForOneConv().eval(), torch.randn(2, 5, 32), ws)
    assert sm.plan.modules == {"q": "column", "k": "column", "v": "column", "conv": "channels", "out_v": "row",
                               "out_qk": "row"}, sm.plan.modules
    _gradients_equal(model, sm)


class FusedForOneConv(nn.Module):
    """One projection of q|k|v (24 + 24 + 48), channels first through a causal depthwise convolution and an
    activation, then split: the split sizes are found past the convolution, so the projection is cut in segments."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96)
        self.conv = nn.Conv1d(96, 96, 3, groups=96, padding=2)
        self.out_v, self.out_qk = nn.Linear(48, 32), nn.Linear(24, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.conv(self.qkv(x).transpose(1, 2))[..., : x.shape[1]]).transpose(1, 2)
        q, k, v = torch.split(h, [24, 24, 48], dim=-1)
        return self.out_v(v) + self.out_qk(q * k)


@pytest.mark.parametrize("ws", [2, 3])
def test_split_sizes_are_found_past_a_depthwise_convolution(ws: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpcompile.TPCompileWarning)
        sm = _check(model := FusedForOneConv().eval(), torch.randn(2, 5, 32), ws)
    assert sm.plan.modules == {"qkv": "column", "conv": "channels", "out_v": "row", "out_qk": "row"}, sm.plan.modules
    assert sm.plan.parameters["qkv.weight"].segments == (24, 24, 48)
    _gradients_equal(model, sm)
