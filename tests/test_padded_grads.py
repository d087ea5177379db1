"""Gradients through ops whose derivative is unbounded where a zero-padded split holds its padding.

The padding of a split the world size does not divide holds zeros (or what an op made of them); an op such as
sqrt(1 - exp(0)) has an infinite derivative there. Its output gradient at the padding is zero (the row split after
it drops the padding), so the chain rule gives 0 * inf = nan at the padding, and the nan then crosses into real
gradients through the padded rows of the weights before it (nan * 0). Each model here has such an op on a padded
value, its real entries well inside the op's domain: the gradients at 3 and 5 ranks must equal the original's.
Where such an op makes an infinity of the padding (log(0), 1/0), a zero-padded value times it is nan there, not zero:
the outputs must still equal the original's (the row split zeroes that padding) and the gradients too.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import tpcompile
from tpcompile.runtime import launch

from padded_checks import shard as _shard
from sgd_steps import loss_gap, sgd_losses


class _PaddedWidth(torch.nn.Module):
    """norm -> up (column, 38 features: padded at 3 and 5 ranks) ... down (row), and one value a feature (`scale`),
    which the padding of its slice makes zero there."""

    def __init__(self, width: int = 38) -> None:
        super().__init__()
        self.norm = torch.nn.RMSNorm(32)
        self.up, self.down = torch.nn.Linear(32, width), torch.nn.Linear(width, 32)
        self.scale = torch.nn.Parameter(torch.rand(width) + 0.5)


class DecayGate(_PaddedWidth):
    """A gated linear recurrence's normaliser: sqrt(1 - a^2), a = exp(-sigmoid(gate) * softplus(rate)), the rate one
    value a channel (the padding of the sliced rate, and so of a, makes 1 - a^2 zero)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        a = torch.exp(-torch.sigmoid(self.up(x)) * F.softplus(self.scale))
        return self.down(torch.sqrt(1 - a * a) * x.mean(-1, keepdim=True))


class InverseScale(_PaddedWidth):
    """A channel-wise scale divided by and logged: x / s and log(s), s = softplus(scale) * sigmoid(up(x)) (zero at
    the padding), then a reciprocal square root and a power below one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        s = F.softplus(self.scale) * torch.sigmoid(self.up(x))
        h = torch.log(s) + x.mean(-1, keepdim=True) / s + torch.rsqrt(s) + s.pow(0.5)
        return self.down(h)


@pytest.mark.parametrize("ws", [3, 5])
@pytest.mark.parametrize("cls", [DecayGate, InverseScale])
def test_gradients_through_singular_ops_on_padding(cls: type, ws: int) -> None:
    torch.manual_seed(0)
    model = cls()
    sm, warned = _shard(model, ws)
    assert warned == []
    assert sm.plan.parameters["up.weight"].role == "column" and sm.plan.parameters["down.weight"].role == "row"
    x = torch.randn(3, 7, 32)
    report = tpcompile.check_gradients(model, sm, x)
    assert report.ok, str(report)

    def finite(r: int) -> list[str]:  # the padded rows' gradients too (a clipped norm would be nan)
        rank = sm.rank(r)
        rank(x).square().sum().backward()
        return [n for n, p in rank.named_parameters() if p.grad is not None and not p.grad.isfinite().all()]
    assert tpcompile.simulate_ranks(ws, finite) == [[]] * ws


def _sgd_on_gloo(rank: int) -> dict:
    """On one of 3 gloo processes: three SGD steps of each model above parallelized, their losses' largest relative
    difference from one process's."""
    out = {}
    for name, make in (("DecayGate", DecayGate), ("InverseScale", InverseScale),
                       ("InfiniteFactor", lambda: InfiniteFactor("reciprocal"))):
        torch.manual_seed(0)
        model = make()
        xs = [torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(i)) for i in range(3)]
        want = sgd_losses(copy.deepcopy(model).train(), xs, lr=0.1)
        got = sgd_losses(tpcompile.parallelize(model, example_inputs=(torch.randn(2, 5, 32),)).train(), xs, lr=0.1)
        out[name] = loss_gap(got, want)
    return out


@pytest.mark.gloo
def test_sgd_through_singular_ops_on_three_processes() -> None:
    """Three SGD steps on 3 gloo processes equal one process's (a nan gradient would make the losses nan)."""
    for rank, diffs in enumerate(launch(3, _sgd_on_gloo, timeout=300)):
        assert len(diffs) == 3 and max(diffs.values()) < 1e-4, (rank, diffs)


class InfiniteFactor(_PaddedWidth):
    """A zero-padded projection times a factor whose padding is infinite (1 / s, log s; s zero at the padding): the
    product's padding is nan, not zero, so the row split after it must zero it, and the product's gradient for the
    projection (the factor) must not reach the padding."""

    def __init__(self, kind: str, width: int = 38) -> None:
        super().__init__(width)
        self.kind, self.gate = kind, torch.nn.Linear(32, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        s = F.softplus(self.scale) * torch.sigmoid(self.gate(x))
        factor = 1 / s if self.kind == "reciprocal" else torch.log(s)
        return self.down(self.up(x) * factor)


@pytest.mark.parametrize("ws", [3, 5])
@pytest.mark.parametrize("kind", ["reciprocal", "log"])
def test_zero_times_an_infinite_padding_is_not_zero(kind: str, ws: int) -> None:
    torch.manual_seed(0)
    model = InfiniteFactor(kind)
    sm, warned = _shard(model, ws)
    assert warned == [] and sm.plan.parameters["up.weight"].role == "column"
    x = torch.randn(3, 7, 32)
    with torch.no_grad():
        for out in tpcompile.simulate(sm, x):
            torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-4)
    report = tpcompile.check_gradients(model, sm, x)
    assert report.ok, str(report)


class QKNormAttention(torch.nn.Module):
    """4 heads, queries and keys normalised per head (rsqrt(mean(q^2) + eps)): at the padded heads rsqrt(0 + eps), a
    finite value with a finite derivative, which needs no mask."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(32, 32) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, 4, 8).transpose(1, 2) for p in (self.q, self.k, self.v))
        q, k = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) for h in (q, k))
        return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, 32))


@pytest.mark.parametrize("cls, masked", [(QKNormAttention, False), (DecayGate, True)])
def test_masks_only_where_the_padding_needs_them(cls: type, masked: bool) -> None:
    """The padding's value is worked out op by op (sharding_rules/padding_values.py): rsqrt(0 + eps) is finite, so
    a per-head norm at 3 ranks (4 heads, the last rank's padded) gets no mask; sqrt(1 - exp(-0)) does, on the rank
    holding padding only."""
    torch.manual_seed(0)
    model = cls()
    sm, warned = _shard(model, 3)
    assert warned == []
    wheres = [sum(n.target is torch.ops.aten.where.self for n in sm.rank(r).graph.nodes) for r in range(3)]
    assert wheres == ([0, 0, 1] if masked else [0, 0, 0]), wheres
    assert tpcompile.check_gradients(model, sm, torch.randn(3, 7, 32)).ok
