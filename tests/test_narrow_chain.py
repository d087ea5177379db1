"""A narrow projection feeding projections that stay narrow (a few coefficients a token that weight other
activations, Gemma 3n's AltUp) is kept whole, with its note in the plan, at any world size; a LoRA-style pair
whose up-projection widens back keeps its up-projection split."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpcompile

WIDTH, STREAMS = 64, 4


class MixedStreams(nn.Module):
    """Four streams of the residual mixed per token by coefficients computed from it: a router (64 -> 4), tanh
    cast back to the input's dtype (`type_as`), one projection to a 4 x 4 mixing matrix (4 -> 16, reshaped by
    the router output's own sizes) and one to a scale per stream (4 -> 4); then an MLP, split as usual."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.router = nn.Linear(WIDTH, STREAMS, bias=False)
        self.coefs = nn.Linear(STREAMS, STREAMS * STREAMS, bias=False)
        self.scales = nn.Linear(STREAMS, STREAMS, bias=False)
        self.up, self.down = nn.Linear(WIDTH, 200), nn.Linear(200, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        streams = torch.stack([x, torch.tanh(x), 0.5 * x, x.flip(-1)])  # (4, B, T, C)
        r = torch.tanh(self.router(self.norm(x)).float()).type_as(x)  # (B, T, 4)
        mix = self.coefs(r).reshape(*r.shape[:-1], STREAMS, STREAMS).permute(0, 1, 3, 2)
        mixed = torch.matmul(streams.permute(1, 2, 3, 0), mix).permute(3, 0, 1, 2)  # (4, B, T, C)
        w = (self.scales(r) + 1.0).permute(2, 0, 1).unsqueeze(-1)  # (4, B, T, 1)
        h = (mixed * w).sum(0)
        return h + self.down(F.gelu(self.up(h)))


class LoRA(nn.Module):
    """A LoRA pair beside a projection to `out` features: A (64 -> 4) whole, B (4 -> out) added to the projection
    and split with it, also where the projection is half the model's width (a kv projection's)."""

    def __init__(self, out: int = WIDTH) -> None:
        super().__init__()
        self.base, self.a, self.b = nn.Linear(WIDTH, out), nn.Linear(WIDTH, 4, bias=False), nn.Linear(4, out)
        self.out = nn.Linear(out, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.base(x) + 0.5 * self.b(self.a(x))))


@pytest.mark.parametrize("ws", [2, 3, 5])
def test_narrow_chain_is_whole_at_any_world_size(ws: int) -> None:
    model = MixedStreams().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, ws, example_inputs=(torch.randn(2, 6, WIDTH),))
    assert sm.plan.modules == {"router": "replicated", "coefs": "replicated", "scales": "replicated",
                               "up": "column", "down": "row"}, sm.plan.modules
    for name in ("router", "coefs", "scales"):
        assert "narrow projection" in sm.plan.replicated[name], sm.plan.replicated
    assert [c for c, _ in sm.collectives()] == ["all_reduce"]
    x = torch.randn(3, 5, WIDTH)
    with torch.no_grad():
        for out in tpcompile.simulate(sm, x):
            torch.testing.assert_close(out, model(x), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("out", [WIDTH, WIDTH // 2])
def test_lora_pair_keeps_its_up_projection_split(out: int) -> None:
    model = LoRA(out).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, 2, example_inputs=(torch.randn(2, 6, WIDTH),))
    assert sm.plan.modules == {"base": "column", "a": "replicated", "b": "column", "out": "row"}, sm.plan.modules
    assert "low-rank down-projection" in sm.plan.replicated["a"]
    x = torch.randn(3, 5, WIDTH)
    with torch.no_grad():
        for out in tpcompile.simulate(sm, x):
            torch.testing.assert_close(out, model(x), atol=2e-5, rtol=1e-5)
