"""Dropout in sharded graphs: same mask on replicated values, a rank's own mask on its shard."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import tpcompile
import tpcompile.ops.rng
from tpcompile.models import GPT, GPTConfig


class ReplicatedDropout(nn.Module):
    """Column / row pair, then dropout on the replicated result."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(16, 64), nn.Linear(64, 16), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.down(torch.relu(self.up(x))))


class ShardedDropout(nn.Module):
    """Dropout on a column split's output, kept sharded at the output."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.drop = nn.Linear(16, 64), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.up(x))


def test_replicated_region_draws_one_mask() -> None:
    """Every rank drops the same elements of a replicated value, so their copies stay equal."""
    model = ReplicatedDropout().train()
    sm = tpcompile.shard(model, 4, example_inputs=(torch.randn(8, 16),))
    tpcompile.ops.rng.seed(1)
    outs = tpcompile.simulate(sm, torch.randn(64, 16))
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], atol=0, rtol=0)
    dropped = float((outs[0] == 0).float().mean())
    assert 0.4 < dropped < 0.6


def test_sharded_region_draws_a_mask_per_rank_and_reseeds() -> None:
    """Each rank draws its own mask for its shard; the same seed gives the same masks again."""
    model = ShardedDropout().train()
    sm = tpcompile.shard(model, 2, example_inputs=(torch.randn(8, 16),), plan={"up": "sharded_output"})
    x = torch.randn(32, 16)
    tpcompile.ops.rng.seed(7)
    first = tpcompile.simulate(sm, x)
    tpcompile.ops.rng.seed(7)
    again = tpcompile.simulate(sm, x)
    tpcompile.ops.rng.seed(8)
    other = tpcompile.simulate(sm, x)
    zeros = [(o == 0) for o in first]
    assert zeros[0].shape == zeros[1].shape == (32, 32)
    assert not torch.equal(zeros[0], zeros[1])
    for a, b in zip(first, again):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert not torch.equal(first[0] == 0, other[0] == 0)


@pytest.mark.parametrize("attention", ["sdpa", "manual"])
def test_attention_dropout_spelled_out_is_exact(attention: str) -> None:
    """SDPA with dropout is rewritten to explicit attention; with p near 0 it equals the original."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(dropout=1e-9, attention=attention)).train()
    sm = tpcompile.shard(model, 2)
    assert "dropout_mask" in sm.rank(0).code
    idx = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        ref = model(idx)
        for o in tpcompile.simulate(sm, idx):
            torch.testing.assert_close(o, ref, atol=1e-5, rtol=0)


def test_gpt_with_dropout_is_reproducible_and_trains() -> None:
    """A GPT with dropout 0.1 trains with the same loss on every rank, and the loss falls."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(dropout=0.1)).train()
    sm = tpcompile.shard(model, 2)
    ranks = [sm.rank(r) for r in range(2)]
    idx = torch.randint(0, 256, (4, 16))

    def train(r: int) -> list[float]:
        opt = torch.optim.AdamW(ranks[r].parameters(), lr=3e-3)
        losses = []
        for _ in range(8):
            logits = ranks[r](idx)
            loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 256), idx[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    tpcompile.ops.rng.seed(3)
    losses = tpcompile.simulate_ranks(2, train)
    assert losses[0] == losses[1]
    assert losses[0][-1] < losses[0][0] - 0.5
