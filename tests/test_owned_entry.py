"""One row of a table split by vocabulary rows (`table[pad_id]`, a placeholder token's embedding put where the
model marks special positions) is held by one rank: that rank gives the row, the others zeros, and the sum stays
pending like the lookup's. The table and its tied head stay split instead of being kept whole."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import tpcompile


class Placeholders(nn.Module):
    """Token embeddings, with the positions holding `marker` replaced by the embedding of row `row` (the table's
    padding row, as multimodal models do before merging other features), an MLP and a tied head."""

    def __init__(self, vocab: int = 40, dim: int = 16, marker: int = 3, row: int = 0) -> None:
        super().__init__()
        self.marker, self.row = marker, row
        self.tokens = nn.Embedding(vocab, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        marked = (ids == self.marker).unsqueeze(-1)
        x = torch.where(marked, self.tokens.weight[self.row].view(1, 1, -1), self.tokens(ids))
        x = x + self.down(torch.relu(self.up(self.norm(x))))
        return self.head(self.norm(x))


def _ids(batch: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    """Token ids with the marker (3) at a few positions."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, length), generator=g)
    ids[:, ::3] = 3
    return ids


@pytest.mark.parametrize("ws,vocab,row", [(2, 40, 0), (4, 40, 0), (4, 40, 37), (3, 40, -1), (4, 50, 49)])
def test_a_split_tables_row_is_its_owners(ws: int, vocab: int, row: int) -> None:
    """The table (and its tied head) split by rows, zero-padded where the world size does not divide them; no
    warning; the row's pending sum joins the lookups' (one all-reduce for both); equal, gradients too."""
    torch.manual_seed(0)
    model = Placeholders(vocab=vocab, row=row).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sm = tpcompile.shard(model, ws, example_inputs=(_ids(2, 7, vocab, 1),))
    assert [str(w.message) for w in caught if issubclass(w.category, tpcompile.TPCompileWarning)] == []
    assert sm.plan.modules["tokens"] == "vocab"
    assert sm.plan.parameters["tokens.weight"].local_shape == (-(-vocab // ws), 16)
    forward = [op for op, _ in sm.collectives()]
    assert forward == ["all_reduce", "all_reduce", "all_gather_replicated"]  # row + lookups, the MLP, the head
    x = _ids(3, 11, vocab, 2)
    with torch.no_grad():
        ref = model(x)
        for out in tpcompile.simulate(sm, x):
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    report = tpcompile.check_gradients(model, sm, _ids(2, 9, vocab, 3))
    assert report.ok, str(report)


class ActivationEntry(nn.Module):
    """A column-split projection whose output is read one feature at a time (`h[..., 0]`): an activation's entry,
    which is not made pending (its producer kept whole costs no collective)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, 8)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x) * self.proj(x)[..., 0:1].sigmoid()


def test_an_activations_entry_along_its_split_stays_a_conflict() -> None:
    """Reading one feature of a split activation keeps its producer whole, as before: equal, no pending entry."""
    torch.manual_seed(0)
    model = ActivationEntry().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sm = tpcompile.shard(model, 2, example_inputs=(torch.randn(2, 5, 16),))
    assert sm.plan.modules["proj"] != "column"
    x = torch.randn(3, 6, 16)
    with torch.no_grad():
        for out in tpcompile.simulate(sm, x):
            torch.testing.assert_close(out, model(x), atol=1e-5, rtol=0)
