"""Tables read with indices other than the token ids (positions, token types) are split by rows when their sums
join the token embeddings' pending sum: one all-reduce for all of them, as for the token embeddings alone. Where
such a sum would need an all-reduce of its own (a bias table added to split attention scores, a position table
next to token embeddings kept whole), the table stays whole, as a choice shown in the plan, without a warning."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import tpcompile
from tpcompile.ops import collectives as C


class Embeddings(nn.Module):
    """Token, token-type and position embeddings summed, normalised, then a two-layer MLP and a head."""

    def __init__(self, vocab: int = 40, positions: int = 24, types: int = 2, dim: int = 16) -> None:
        super().__init__()
        self.tokens, self.types = nn.Embedding(vocab, dim), nn.Embedding(types, dim)
        self.positions = nn.Embedding(positions, dim)
        self.register_buffer("position_ids", torch.arange(positions)[None], persistent=False)
        self.register_buffer("type_ids", torch.zeros(1, positions, dtype=torch.long), persistent=False)
        self.norm = nn.LayerNorm(dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        x = self.tokens(ids) + self.types(self.type_ids[:, :t].expand(ids.shape[0], t))
        x = self.norm(x + self.positions(self.position_ids[:, :t]))
        return self.head(x + self.down(torch.relu(self.up(x))))


class BiasTable(nn.Module):
    """Attention whose scores get a per-head bias looked up from a table by relative distance."""

    def __init__(self, dim: int = 16, heads: int = 4, distances: int = 16) -> None:
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.bias = nn.Embedding(distances, heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        pos = torch.arange(t, device=x.device)
        rel = (pos[None] - pos[:, None]).abs().clamp(max=self.bias.num_embeddings - 1)
        scores = q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5 + self.bias(rel).permute(2, 0, 1)
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d))


def _shard(model: nn.Module, ws: int, example: torch.Tensor, **kw) -> tuple[tpcompile.ShardedModel, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sm = tpcompile.shard(model, ws, example_inputs=(example,), **kw)
    return sm, [str(w.message) for w in caught if issubclass(w.category, tpcompile.TPCompileWarning)]


def _equal(sm: tpcompile.ShardedModel, model: nn.Module, x: torch.Tensor) -> None:
    """Every rank's output equal to the original's on `x`."""
    with torch.no_grad():
        ref = model(x)
        for out in tpcompile.simulate(sm, x):
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def _forward_collectives(sm: tpcompile.ShardedModel, x: torch.Tensor) -> list[str]:
    with torch.no_grad(), C.record() as events:
        tpcompile.simulate(sm, x)
    return [e.op for e in events if e.rank == 0 and e.phase == "forward"]


@pytest.mark.parametrize("ws", [2, 4])
def test_position_and_type_tables_split_with_the_token_embeddings(ws: int) -> None:
    torch.manual_seed(0)
    model = Embeddings().eval()
    sm, texts = _shard(model, ws, torch.randint(0, 40, (2, 8)))
    assert texts == []
    for name, rows in (("tokens.weight", 40), ("positions.weight", 24), ("types.weight", 2)):
        pp = sm.plan.parameters[name]
        assert pp.dim == 0 and pp.local_shape[0] == -(-rows // ws), (name, pp)  # rows padded to a multiple of ws
    x = torch.randint(0, 40, (3, 11))
    _equal(sm, model, x)
    # the three lookups' sums, one all-reduce; the MLP's row split one more; the head's gather
    assert _forward_collectives(sm, x) == ["all_reduce", "all_reduce", "all_gather_replicated"]
    report = tpcompile.check_gradients(model, sm, x)
    assert report.ok, str(report)


def test_bias_table_added_to_split_scores_stays_whole() -> None:
    """Summed into scores split by heads, the table's sum would be reduced alone: whole, no warning, in the plan."""
    torch.manual_seed(0)
    model = BiasTable().eval()
    sm, texts = _shard(model, 2, torch.randn(2, 6, 16))
    assert texts == []
    assert sm.plan.parameters["bias.weight"].dim is None
    assert sm.plan.parameters["qkv.weight"].dim == 0  # the attention itself stays split by heads
    assert any("all-reduce of its own" in why for why in sm.plan.replicated.values()), sm.plan.replicated
    x = torch.randn(3, 9, 16)
    _equal(sm, model, x)
    assert _forward_collectives(sm, x) == ["all_reduce"]


def test_position_table_beside_whole_token_embeddings_stays_whole() -> None:
    """The token embeddings kept whole by the plan: the position table alone would cost an all-reduce."""
    torch.manual_seed(0)
    model = Embeddings().eval()
    sm, _ = _shard(model, 2, torch.randint(0, 40, (2, 8)), plan={"tokens": "replicate"})
    for name in ("tokens.weight", "positions.weight", "types.weight"):
        assert sm.plan.parameters[name].dim is None, name
    x = torch.randint(0, 40, (3, 11))
    assert _forward_collectives(sm, x) == ["all_reduce", "all_gather_replicated"]


def test_sequence_parallel_splits_only_the_token_table() -> None:
    """Under sequence parallelism each lookup is reduce-scattered at once: the other tables stay whole."""
    torch.manual_seed(0)
    model = Embeddings().eval()
    sm, _ = _shard(model, 2, torch.randint(0, 40, (2, 8)), sequence_parallel=True)
    assert sm.plan.parameters["tokens.weight"].dim == 0
    assert sm.plan.parameters["positions.weight"].dim is None and sm.plan.parameters["types.weight"].dim is None
    x = torch.randint(0, 40, (3, 8))
    _equal(sm, model, x)


class TimeMajor(nn.Module):
    """Token ids laid out (T, B) by a transpose before the lookup (XLNet's), a norm, an MLP and a head."""

    def __init__(self, vocab: int = 40, dim: int = 16) -> None:
        super().__init__()
        self.tokens, self.norm = nn.Embedding(vocab, dim), nn.LayerNorm(dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.tokens(ids.transpose(0, 1).contiguous()))  # (T, B, dim)
        x = x + self.down(torch.relu(self.up(x)))
        return self.head(x.transpose(0, 1))


@pytest.mark.parametrize("ws", [2, 4])
def test_transposed_token_ids_are_still_the_token_ids(ws: int) -> None:
    """A transpose of the user's token ids is not another index: the table splits by rows, no warning."""
    torch.manual_seed(0)
    _split_by_rows_with_one_reduce(TimeMajor().eval(), ws, ["tokens.weight"])


def _split_by_rows_with_one_reduce(model: nn.Module, ws: int, tables: list[str]) -> None:
    """`tables` split by rows without a warning; equal, the lookups reduced by one all-reduce (the MLP's row split
    one more, the head's gather), gradients equal."""
    sm, texts = _shard(model, ws, torch.randint(0, 40, (2, 8)))
    assert texts == []
    assert all(sm.plan.parameters[t].dim == 0 for t in tables)
    x = torch.randint(0, 40, (3, 11))
    _equal(sm, model, x)
    assert _forward_collectives(sm, x) == ["all_reduce", "all_reduce", "all_gather_replicated"]
    report = tpcompile.check_gradients(model, sm, x)
    assert report.ok, str(report)


class PromptIds(nn.Module):
    """Ids of `prompt` learned prompt tokens (rows past the vocabulary) prepended to the token ids, a segment table
    read with ids made from the token ids (0 on the prompt), then a norm, an MLP and a head (CPM-Ant's inputs)."""

    def __init__(self, vocab: int = 40, prompt: int = 4, dim: int = 16) -> None:
        super().__init__()
        self.vocab, self.prompt = vocab, prompt
        self.tokens, self.segments = nn.Embedding(vocab + prompt, dim), nn.Embedding(3, dim)
        self.norm = nn.LayerNorm(dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b = ids.shape[0]
        prompt = torch.arange(self.vocab, self.vocab + self.prompt, device=ids.device).repeat(b, 1)
        segment = torch.cat([torch.zeros_like(prompt), torch.where(ids != 0, 2, 1)], dim=1)
        x = self.norm(self.tokens(torch.cat([prompt, ids], dim=1)) + self.segments(segment))
        return self.head(x + self.down(torch.relu(self.up(x))))


@pytest.mark.parametrize("ws", [2, 4])
def test_token_ids_behind_constant_prompt_ids_are_still_the_token_ids(ws: int) -> None:
    """A cat of ids made from constants alone and the token ids is the token ids: the token table (and the
    segment table, whose sum joins it) split by rows, one all-reduce for both, no warning."""
    torch.manual_seed(0)
    _split_by_rows_with_one_reduce(PromptIds().eval(), ws, ["tokens.weight", "segments.weight"])


class IdsWithOtherInput(nn.Module):
    """Token ids joined with a second id input of the model before one lookup: not ids made from constants."""

    def __init__(self, vocab: int = 40, dim: int = 16) -> None:
        super().__init__()
        self.tokens, self.types = nn.Embedding(vocab, dim), nn.Embedding(vocab, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, ids: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        x = self.types(torch.cat([extra, ids], dim=1))
        return x + self.down(torch.relu(self.up(x)))


def test_ids_joined_with_another_input_are_not_taken_for_token_ids() -> None:
    """The joined ids read a second model input: the lookup is a side lookup whose sum would be reduced alone, so
    its table stays whole as a choice (no warning), as before."""
    torch.manual_seed(0)
    model = IdsWithOtherInput().eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sm = tpcompile.shard(model, 2, example_inputs=(torch.randint(0, 40, (2, 8)), torch.randint(0, 40, (2, 3))))
    assert [w for w in caught if issubclass(w.category, tpcompile.TPCompileWarning)] == []
    assert sm.plan.parameters["types.weight"].dim is None
