"""PyTorch's own attention modules shard by whole heads: nn.MultiheadAttention, nn.TransformerEncoder."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import tpcompile


class Encoder(nn.Module):
    """Two nn.TransformerEncoderLayer blocks (batch first, post-norm)."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.enc(x)


@pytest.mark.parametrize("ws", [2, 4])
def test_transformer_encoder_two_all_reduces_per_layer(ws: int) -> None:
    """Each encoder layer: attention by heads (in_proj per q/k/v segment) and MLP, 2 all-reduces."""
    torch.manual_seed(0)
    model = Encoder().eval()
    sm = tpcompile.shard(model, ws, example_inputs=(torch.randn(2, 8, 64),))
    assert not sm.plan.warnings
    assert sm.plan.parameters["enc.layers.0.self_attn.in_proj_weight"].segments == (64, 64, 64)
    assert sm.plan.modules["enc.layers.1.self_attn.out_proj"] == "row"
    assert [op for op, _ in sm.collectives()] == ["all_reduce"] * 4
    x = torch.randn(3, 11, 64)
    with torch.no_grad():
        ref = model(x)
        for out in tpcompile.simulate(sm, x):
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_multihead_attention_gradients_are_slices() -> None:
    """nn.MultiheadAttention trains sharded: each rank's in_proj gradient is its q|k|v slices."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(64, 4, batch_first=True)

    class Wrap(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mha = mha

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mha(x, x, x, need_weights=False)[0]

    model = Wrap()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 8, 64)
    sm = tpcompile.shard(model, 2, example_inputs=(x,))
    ranks = [sm.rank(r) for r in range(2)]
    ref(x).pow(2).mean().backward()
    full = ref.mha.in_proj_weight.grad

    def grad(r: int) -> torch.Tensor:
        ranks[r](x).pow(2).mean().backward()
        return ranks[r].get_parameter("mha.in_proj_weight").grad

    for r, g in enumerate(tpcompile.simulate_ranks(2, grad)):
        want = torch.cat([full[s * 64 + r * 32: s * 64 + (r + 1) * 32] for s in range(3)])
        torch.testing.assert_close(g, want, atol=1e-6, rtol=1e-4)
