"""A vocabulary table shared by the embedding and the output head, and token ids the model derives from its input.

A masked-LM head (dense, GELU, LayerNorm, then the decoder tied to the embedding) would split its dense layer and
so read the tied table by its input features, while the embedding reads it by rows: the plan keeps the small
dense layer whole (a planned choice, shown in the plan, no warning) so that the table is cut one way, by rows of
the vocabulary, at both readers. Token ids that are a slice of the input or a copy with some ids rewritten still
feed a vocabulary-parallel embedding, whose range check guards them whatever their source.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpcompile

V, H, F_ = 96, 32, 64


class MaskedLM(nn.Module):
    """Embedding, one MLP block, a transform (dense, GELU, LayerNorm) and a decoder tied to the embedding."""

    def __init__(self, vocab: int = V) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, H)
        self.up, self.down = nn.Linear(H, F_), nn.Linear(F_, H)
        self.dense, self.norm = nn.Linear(H, H), nn.LayerNorm(H)
        self.decoder = nn.Linear(H, vocab)
        self.decoder.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + self.down(F.gelu(self.up(h)))
        return self.decoder(self.norm(F.gelu(self.dense(h))))


def _shard(model: nn.Module, ws: int, **kw: object) -> tuple[tpcompile.ShardedModel, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, ws, example_inputs=(torch.randint(0, 90, (2, 8)),), **kw)
    return sm, [str(w.message) for w in caught if issubclass(w.category, tpcompile.TPCompileWarning)]


@pytest.mark.parametrize("ws", [2, 4])
def test_a_tied_table_is_cut_by_rows_at_both_readers(ws: int) -> None:
    torch.manual_seed(0)
    model = MaskedLM().eval()
    sm, warned = _shard(model, ws)
    assert not warned, warned
    table = sm.plan.parameters["emb.weight"]
    assert (table.role, table.local_shape) == ("vocab", (V // ws, H)) and "decoder.weight" in table.tied
    assert sm.plan.parameters["dense.weight"].role == "replicated"
    why = sm.plan.replicated["dense"]
    assert "so that decoder.weight is cut one way: along dim 0 as its other readers cut it" in why, why
    assert sm.plan.parameters["up.weight"].role == "column"
    ids = torch.randint(0, V, (3, 11))
    with torch.no_grad():
        ref = model(ids)
        for out in tpcompile.simulate(sm, ids):
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    report = tpcompile.check_gradients(model.train(), sm, torch.randint(0, V, (2, 7)))
    assert report.ok, str(report)


def test_a_table_smaller_than_the_transform_is_whole_with_a_warning() -> None:
    """8 rows of 32 against a 32 x 32 transform: keeping the transform whole would save less than it costs, so the
    disagreement stays a warning and the table is whole; exact."""
    torch.manual_seed(0)
    model = MaskedLM(vocab=8).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, 2, example_inputs=(torch.randint(0, 8, (2, 8)),))
    assert any("used both split and whole" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert sm.plan.parameters["emb.weight"].role == "replicated"
    ids = torch.randint(0, 8, (3, 5))
    with torch.no_grad():
        for out in tpcompile.simulate(sm, ids):
            torch.testing.assert_close(out, model(ids), atol=1e-5, rtol=0)


class DerivedIds(nn.Module):
    """Ids rewritten in a copy (a special id mapped to 0, as multimodal models do) and a slice of them."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.up, self.down = nn.Linear(H, F_), nn.Linear(F_, H)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.clone()
        ids[ids == 5] = 0
        h = self.emb(ids[:, 1:])
        return h + self.down(F.gelu(self.up(h)))


def test_ids_derived_from_the_input_feed_a_vocabulary_split() -> None:
    torch.manual_seed(0)
    model = DerivedIds().eval()
    sm, warned = _shard(model, 2)
    assert not warned, warned
    assert sm.plan.parameters["emb.weight"].role == "vocab"
    ids = torch.randint(0, V, (3, 9))
    ids[0, 3] = 5
    with torch.no_grad():
        ref = model(ids)
        for out in tpcompile.simulate(sm, ids):
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
        ids[1, 4] = V + 3  # out of range: the original raises, and so does every rank
        with pytest.raises(IndexError):
            model(ids)
        with pytest.raises(tpcompile.TPCompileError, match=f"token id {V + 3}"):
            tpcompile.simulate(sm, ids)
