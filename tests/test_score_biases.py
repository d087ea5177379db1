"""Parts of grouped-query attention computed per head beside q, k and v, cut with the heads they belong to where each
kv group's query heads are cut among the ranks holding its kv head (passes/head_groups.py): a bias of the scores
from a projection (tests/score_models.py RelativeBiasAttention) as the query heads, a projection of values per kv head
that k or v is multiplied by (TappedKeyAttention) as the kv heads. Replicated with a warning, or the whole attention
padded by whole groups, before."""
from __future__ import annotations

import pytest
import torch

import tpcompile
from tpcompile.sharding_rules.group_cuts import group_cuts

from padded_checks import equal, shard
from score_models import HEAD, HEADS, KV, REL, RelativeBiasAttention, TappedKeyAttention


def _exact(model: torch.nn.Module, sm: tpcompile.ShardedModel) -> None:
    """Every rank's output equals the model's on another batch and length, and every gradient agrees."""
    equal(model, sm)
    report = tpcompile.check_gradients(model.train(), sm, torch.randn(2, 9, 32))
    assert report.ok, str(report)


@pytest.mark.parametrize("ws", [5, 6])
@pytest.mark.parametrize("eager", [False, True, "first"], ids=["sdpa", "eager", "bias_first"])
def test_a_bias_of_the_scores_is_cut_as_the_query_heads(eager: object, ws: int) -> None:
    """The bias projection holds each rank's query heads' states (one query head a rank, REL states each), cut within
    the kv groups as q is; the bank whole, applied to the rank's heads; no warning, two all-reduces (one a block and
    the output's), exact forward and gradients."""
    torch.manual_seed(0)
    model = RelativeBiasAttention(eager).eval()
    sm, warned = shard(model, ws)
    assert not warned, warned
    share, group = -(-ws // KV), HEADS // KV
    q, r, k = (sm.plan.parameters[f"{n}.weight"] for n in ("q", "r", "k"))
    assert q.cuts == group_cuts(KV, group * HEAD, HEAD, share, ws) and q.local_shape == (HEAD, 32)
    assert (r.role, r.local_shape, r.cuts) == ("column", (REL, 32), group_cuts(KV, group * REL, REL, share, ws))
    assert (k.local_shape, k.pieces) == ((HEAD, 32), KV)
    assert sm.plan.parameters["bank"].dim is None
    assert sorted(op for op, _ in sm.collectives()) == ["all_reduce"]
    _exact(model, sm)


@pytest.mark.parametrize("ws", [5, 6])
@pytest.mark.parametrize("summed", [False, True], ids=["blocks", "summed"])
def test_a_projection_per_kv_head_beside_the_key_is_cut_with_the_kv_heads(summed: bool, ws: int) -> None:
    """The key and value projections and their taps hold one kv head a rank (KV pieces, each held by the ranks of its
    query heads), the query heads cut within the kv groups; no warning, exact forward and gradients."""
    torch.manual_seed(0)
    model = TappedKeyAttention(summed).eval()
    sm, warned = shard(model, ws)
    assert not warned, warned
    share, group = -(-ws // KV), HEADS // KV
    q = sm.plan.parameters["q.weight"]
    assert q.cuts == group_cuts(KV, group * HEAD, HEAD, share, ws) and q.local_shape == (HEAD, 32)
    for name, size in (("k", HEAD), ("v", HEAD), ("k_taps", 3 if summed else 4), ("v_taps", 3 if summed else 4)):
        p = sm.plan.parameters[f"{name}.weight"]
        assert (name, p.role, p.local_shape, p.pieces) == (name, "column", (size, 32), KV)
    _exact(model, sm)
