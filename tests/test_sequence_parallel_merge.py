"""Sequence parallelism up to a token merge (patch merging, token pooling): the merge sees whole tokens unless
every rank's share of them is known to reshape on its own, so an odd share never reaches an invalid view."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

import tpcompile

C = 16


class MergeTokens(nn.Module):
    """An MLP block on the tokens (a sequence-parallel region), neighbouring token pairs merged, a projection."""

    def __init__(self, merge: str) -> None:
        super().__init__()
        self.merge = merge
        self.ln, self.fc, self.out = nn.LayerNorm(C), nn.Linear(C, 4 * C), nn.Linear(4 * C, C)
        width = C if merge == "pool" else 2 * C
        self.ln2, self.head = nn.LayerNorm(width), nn.Linear(width, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.out(F.gelu(self.fc(self.ln(x))))
        b, t, c = x.shape
        if self.merge == "view":  # patch merging: (B, T, C) -> (B, T/2, 2C)
            x = x.view(b, t // 2, 2 * c)
        elif self.merge == "unflatten":
            x = x.unflatten(1, (-1, 2)).flatten(2)
        else:  # token pooling: the mean of each pair
            x = x.view(b, -1, 2, c).mean(2)
        return self.head(self.ln2(x))


def _model(merge: str) -> MergeTokens:
    torch.manual_seed(0)
    return MergeTokens(merge).to(torch.float64)


def _x(t: int) -> torch.Tensor:
    return torch.randn(2, t, C, dtype=torch.float64, generator=torch.Generator().manual_seed(t))


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("merge", ["view", "unflatten", "pool"])
def test_merge_after_a_token_split_region_equals_the_original(merge: str, ws: int) -> None:
    """A dynamic length: shares of 3, 2 and 5 tokens per rank all give the original's output and gradients."""
    model = _model(merge)
    sm = tpcompile.shard(model, ws, example_inputs=(_x(4 * ws),), sequence_parallel=True)
    assert [op for op, _ in sm.collectives()][0] == "reduce_scatter"  # the region before the merge is token-split
    ranks = [sm.rank(r) for r in range(ws)]
    for share in (3, 2, 5):
        x = _x(share * ws)
        want = model(x)
        ref = copy.deepcopy(model)
        ref(x).pow(2).sum().backward()

        def run(r: int) -> tuple:
            out = ranks[r](x)
            out.pow(2).sum().backward()
            return out.detach(), ranks[r].get_parameter("ln.weight").grad.clone()

        for out, grad in tpcompile.simulate_ranks(ws, run):
            torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
            torch.testing.assert_close(grad, ref.ln.weight.grad, rtol=0, atol=1e-12)
        for r in ranks:
            r.zero_grad()


@pytest.mark.parametrize("tokens, split", [(6, False), (8, True)])
def test_fixed_token_count_merges_split_only_when_each_share_is_whole_pairs(tokens: int, split: bool) -> None:
    """A length fixed by the model at 2 ranks: 8 tokens (shares of 4) merge on each rank, 6 tokens (shares of
    3) are gathered first; both equal the original."""
    model = _model("view")
    x = _x(tokens)
    with pytest.warns(tpcompile.TPCompileWarning, match=f"dim 1 is fixed at {tokens}"):  # as asked
        sm = tpcompile.shard(model, 2, example_inputs=(x,), sequence_parallel=True,
                             dynamic_shapes=({0: Dim.AUTO, 1: Dim.STATIC, 2: Dim.STATIC},))
    gather = "all_gather" if split else "all_gather_replicated"  # into the head's column split, or at the merge
    assert [op for op, _ in sm.collectives()] == ["reduce_scatter", gather, "all_gather_replicated"]
    for out in tpcompile.simulate(sm, x):
        torch.testing.assert_close(out, model(x), rtol=0, atol=1e-12)
