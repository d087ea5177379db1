"""Parts of grouped-query attention computed per head beside q, k and v, cut with the heads they belong to where each
kv group's query heads are cut among the ranks holding its kv head (passes/head_groups.py): a bias of the scores
from a projection (tests/score_models.py RelativeBiasAttention) as the query heads, a projection of values per kv head
that k or v is multiplied by (TappedKeyAttention) as the kv heads. Replicated with a warning, or the whole attention
padded by whole groups, before."""
from __future__ import annotations

import pytest
import torch

import tpcompile
from tpcompile.runtime import launch
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


def _on_five(rank: int) -> dict:
    """On one of 5 gloo processes (kv head 0 held by ranks 0-2, kv head 1 by ranks 3-4): tpcompile.parallelize of each
    model, its output's largest difference from the original's on another batch and length, and the share of the
    parameters the rank holds."""
    out = {}
    for name, make in (("sdpa", lambda: RelativeBiasAttention()), ("eager", lambda: RelativeBiasAttention(True)),
                       ("bias_first", lambda: RelativeBiasAttention("first")), ("taps", lambda: TappedKeyAttention()),
                       ("summed", lambda: TappedKeyAttention(True))):
        torch.manual_seed(0)
        model = make().eval()
        gm = tpcompile.parallelize(model, example_inputs=(torch.randn(2, 5, 32),))
        x = torch.randn(3, 7, 32, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            out[name] = float((gm(x) - model(x)).abs().max())
        out[f"{name} held"] = sum(p.numel() for p in gm.parameters()) / sum(p.numel() for p in model.parameters())
    return out


@pytest.mark.gloo
def test_on_five_processes() -> None:
    """The biases of the scores and the kv heads' taps on 5 gloo processes: every rank's output equals the
    original's, and every rank holds what the plan's local shapes add up to (0.33 to 0.36 of the parameters; 0.44
    to 0.79 with the bias and the taps whole)."""
    for rank, got in enumerate(launch(5, _on_five, timeout=300)):
        diffs = {k: v for k, v in got.items() if not k.endswith(" held")}
        assert len(diffs) == 5 and max(diffs.values()) < 1e-4, (rank, diffs)
        assert all(0.3 < got[f"{k} held"] < 0.37 for k in diffs), (rank, got)
