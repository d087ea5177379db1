"""Sizes of a token split (sequence parallelism) that the model's inputs do not simply give: a token count the
data decides (patches), a length the model fixes with k entries a token flattened, (B*T, C) views sized at run time,
and splits along the tokens. Each at world sizes that do not divide the length, outputs and gradients against the
original's; none may fix the length the capture left dynamic (pyproject.toml fails a test on that warning).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import tpcompile


class _Patches(nn.Module):
    """A block over patches whose count the data decides (Byte Latent Transformer's): the positions of marked
    tokens, one begin and one end patch around them; two feed-forward blocks on the patches, their mean added back."""

    def __init__(self, vocab: int = 16, dim: int = 24) -> None:
        super().__init__()
        self.emb, self.ends = nn.Embedding(vocab, dim), nn.Parameter(torch.randn(2, dim))
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(),
                                                  nn.Linear(4 * dim, dim)) for _ in range(2))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        marked = torch.nonzero(ids[0] % 3 == 0).squeeze(1)
        ends = self.ends.unsqueeze(0).expand(x.shape[0], -1, -1)
        p = torch.cat([ends[:, :1], x.index_select(1, marked), ends[:, 1:]], 1)
        for block in self.blocks:
            p = p + block(p)
        return self.head(x + p.mean(1, keepdim=True))


@pytest.mark.parametrize("world_size", [3, 5])
def test_a_data_dependent_token_count_is_gathered_at_its_size(world_size: int) -> None:
    """Patches counted from the data split by tokens: the gathers between the blocks are given the count read off
    the whole value each share was cut from (no model input has it). Before, each rank sent its share as it was
    and the ranks' gathers differed in size; outputs and gradients equal the original's."""
    model = _Patches().train()
    ids = torch.tensor([[0, 3, 1, 6, 2, 9, 4, 5, 12, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])
    sm = tpcompile.shard(model, world_size, example_inputs=(ids,), sequence_parallel=True)
    assert any("reduce_scatter" in str(n.target) for n in sm.rank(0).graph.nodes)
    for marks in (4, 6):  # 6 and 8 patches: shares of 2|2|2, 3|3|2 at 3 ranks
        other = torch.randint(1, 16, (3, 13), generator=torch.Generator().manual_seed(marks))
        other[0] = torch.where(torch.arange(13) < marks, 3, 1)
        report = tpcompile.check_gradients(model, sm, other)
        assert report.ok, str(report)


class _FixedLengthTopK(nn.Module):
    """A length the model's code fixes (a learned position table added whole) and a top-2 choice per token flattened
    with the tokens: (B*T, 2) -> (B * 2T), each token's two rows looked up in a table, weighted and summed back."""

    def __init__(self, vocab: int = 16, dim: int = 24, length: int = 8, table: int = 10) -> None:
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, dim), nn.Parameter(torch.randn(length, dim))
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.choices, self.table = table, nn.Parameter(torch.randn(table, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids) + self.pos
        y = x + self.fc2(torch.relu(self.fc1(x)))
        flat = y.reshape(-1, y.shape[-1])  # (B*T, C), routed as a mixture of experts routes
        weights, chosen = torch.softmax(flat[:, :self.choices], -1).topk(2, -1)  # a router of no weight of its own
        rows = self.table[chosen.reshape(-1)].view(*chosen.shape, -1)
        return self.head(y + (rows * weights.unsqueeze(-1)).sum(1).view(y.shape))


@pytest.mark.parametrize("world_size", [3, 5])
def test_top_k_entries_of_a_fixed_token_count_are_not_taken_for_tokens(world_size: int) -> None:
    """A fixed length of 8 tokens, 2 entries each flattened into 16: the size alone reads as 16 tokens, whose shares
    (6|5|5 at 3 ranks) cut through tokens (shares of 3|3|2 tokens hold 6|6|4 entries). The split stops at that
    reshape (the tokens gathered first); before, the ranks failed on sizes that disagreed. Outputs and gradients
    equal the original's."""
    model = _FixedLengthTopK().train()
    ids = torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(0))
    sm = tpcompile.shard(model, world_size, example_inputs=(ids,), sequence_parallel=True)
    assert any("reduce_scatter" in str(n.target) for n in sm.rank(0).graph.nodes)
    report = tpcompile.check_gradients(model, sm, torch.randint(0, 16, (3, 8)))
    assert report.ok, str(report)


class _RelativeLogits(nn.Module):
    """Attention with a bias per head and distance (Inkling's): a fourth part of the fused projection, per head,
    mixes a bank of R profiles into (B, H, T, R), gathered along R by the (T, T) distances into (B, H, T, T)."""

    def __init__(self, dim: int = 32, heads: int = 4, d_rel: int = 4, rel: int = 8) -> None:
        super().__init__()
        self.heads, self.rel, self.sizes = heads, rel, (dim, dim, dim, heads * d_rel)
        self.qkvr, self.o = nn.Linear(dim, sum(self.sizes)), nn.Linear(dim, dim)
        self.profiles = nn.Parameter(torch.randn(d_rel, rel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v, r = (z.view(b, t, self.heads, -1) for z in self.qkvr(x).split(self.sizes, -1))
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        pos = torch.arange(t, device=x.device)
        dist = (pos[:, None] - pos[None, :]).clamp(0, self.rel - 1).expand(b, self.heads, t, t)
        bias = (r @ self.profiles).transpose(1, 2).gather(-1, dist)
        scores = q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5 + bias
        return x + self.o((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d))


def test_sharding_leaves_the_captured_length_dynamic() -> None:
    """An example length equal to the relative positions' count (8): sharding compared the two sizes, which fixed
    the length at 8 after the capture, without a check on the inputs, so the ranks ran other lengths on a graph of
    8 (under sequence parallelism, gathers of 8 tokens). The length stays dynamic: any length equals the original."""
    model = nn.Sequential(_RelativeLogits(), _RelativeLogits()).train()
    sm = tpcompile.shard(model, 3, example_inputs=(torch.randn(2, 8, 32),), sequence_parallel=True)
    holder = next(n for n in sm.rank(0).graph.nodes if n.op == "placeholder")
    assert isinstance(holder.meta["val"].shape[1], torch.SymInt)
    for length in (8, 11):
        report = tpcompile.check_gradients(model, sm, torch.randn(3, length, 32))
        assert report.ok, str(report)


class _FlatGate(nn.Module):
    """A feed-forward block, then its output viewed as (B*T, C) at sizes read off the input (a router's view of the
    tokens, Zaya's), gated per token, and viewed back."""

    def __init__(self, dim: int = 24) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        y = x + self.fc2(torch.relu(self.fc1(self.norm(x))))
        flat = y.view(b * t, c)
        return (flat * torch.sigmoid(flat.sum(-1, keepdim=True))).view(b, t, c)


@pytest.mark.parametrize("world_size,length", [(3, 7), (5, 13)])
def test_a_view_of_flattened_token_shares_is_sized_by_the_share(world_size: int, length: int) -> None:
    """A view to (B*T, C) of a token split is sized B times this rank's share of T, not B*T divided by the ranks
    (which is no rank's size when the ranks do not divide T); outputs and gradients equal the original's."""
    model = nn.Sequential(_FlatGate(), _FlatGate()).train()
    sm = tpcompile.shard(model, world_size, example_inputs=(torch.randn(2, 8, 24),), sequence_parallel=True)
    report = tpcompile.check_gradients(model, sm, torch.randn(3, length, 24))
    assert report.ok, str(report)


class _TwoStreams(nn.Module):
    """Two streams of the same tokens run through one block side by side along the tokens (ProphetNet's main and
    predicting streams), then split apart again at the length read off the input."""

    def __init__(self, dim: int = 24) -> None:
        super().__init__()
        self.block = _FlatGate(dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        both = self.block(torch.cat([x, self.norm(x)], 1))
        main, other = both.split([t, t], 1)
        return main + other


@pytest.mark.parametrize("world_size,length", [(3, 7), (5, 8)])
def test_a_split_along_the_tokens_gathers_them_and_leaves_the_length_dynamic(world_size: int, length: int) -> None:
    """A split of a token split along its tokens: the pieces are not pieces of each rank's share, so the tokens are
    gathered first. Before, the split rule read the pieces' sizes as ints, which fixed the length at the example's
    (the suite fails on the warning that says so); outputs and gradients equal the original's."""
    model = nn.Sequential(_TwoStreams(), _TwoStreams()).train()
    sm = tpcompile.shard(model, world_size, example_inputs=(torch.randn(2, 6, 24),), sequence_parallel=True)
    report = tpcompile.check_gradients(model, sm, torch.randn(3, length, 24))
    assert report.ok, str(report)
