"""A zero-padded split (a width, heads or channels the world size does not divide) through what the models of
tests/padded_models.py do with it: norms, attention, reductions, reshapes, slices and ops the op table has no row
for (DTensor's strategies at the padded size).
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import tpcompile
from tpcompile.runtime import launch

from moe_models import build_moe
from padded_models import (
    NormedMLP, SubNormAttention, GatedAttention, GateViewAs, RowsPerHead, AlibiAttention, StackedGateMLP, ShortConv,
    PaddedTokens, ConvLinearAttention, GatedHeadNorm, InterleavedGLU, SparseActivationMLP, GateTimesWhole,
    LogitStats, EmbeddingPlusProjection, DiffAttention, PairedHeads, WholeInputConvHeads, Recurrent, ExpertHeads,
    SlotHeads)
from padded_checks import equal as _equal, parallel_diffs as _parallel_diffs, shard as _shard, split as _split
from sgd_steps import loss_gap, sgd_losses


@pytest.mark.parametrize("ws", [3, 6])
def test_layer_norm_over_a_padded_split_merges_statistics(ws: int) -> None:
    """100 features at 3 and 6 ranks, zero-padded: the LayerNorm merges the ranks' sums (no warning, the projections
    split, its weight and bias cut like the features); outputs and three SGD steps equal the original's."""
    torch.manual_seed(0)
    model = NormedMLP()
    sm, warned = _shard(model, ws)
    assert warned == []
    roles = {n: p.role for n, p in sm.plan.parameters.items()}
    assert roles["up.weight"] == "column" and roles["down.weight"] == "row" and roles["ln.weight"] == "follows"
    assert sm.plan.parameters["ln.weight"].local_shape == (-(-100 // ws),)
    _equal(model, sm)
    xs = [torch.randn(2, 6, 32) for _ in range(3)]
    want = sgd_losses(copy.deepcopy(model).train(), xs, lr=0.1)
    got = tpcompile.simulate_ranks(ws, lambda r: sgd_losses(sm.rank(r).train(), xs, lr=0.1))
    for losses in got:
        assert losses == pytest.approx(want, rel=1e-4, abs=1e-6)
    with torch.no_grad():  # features far from zero (~1000): merged from deviations, x^2 - mean^2 would cancel
        model.up.bias.add_(1000.0)
        x = torch.randn(3, 7, 32)
        exact = copy.deepcopy(model).double()(x.double())
        own = float((model(x).double() - exact).abs().max())  # the original's own float32 error
        for out in tpcompile.simulate(_shard(model, ws)[0], x):
            assert float((out.double() - exact).abs().max()) <= 2 * own + 1e-5


def test_layer_norm_without_weight_over_a_padded_split_stays_whole() -> None:
    """Without a weight the normalised padding is not zero: the projections before it are kept whole, warned."""
    torch.manual_seed(0)
    model = NormedMLP(affine=False)
    sm, warned = _shard(model, 3)
    assert any("normalises over the sharded dim" in w for w in warned)
    assert sm.plan.parameters["up.weight"].role == "replicated"
    _equal(model, sm)


def test_norm_after_attention_with_padded_heads() -> None:
    """4 heads at 3 ranks (2|2|0 heads, zero-padded): attention keeps the padded heads zero, so the written-out
    norm's mean over the heads' features is the ranks' summed sums; the projections are split, no warning."""
    torch.manual_seed(0)
    _split(SubNormAttention(), 3, tuple(f"qkv.{i}.weight" for i in range(3)), ("o.weight",))


@pytest.mark.parametrize("ws", [3, 6])
def test_ops_without_a_rule_take_a_padded_split(ws: int) -> None:
    """F.pad and max over the tokens of a zero-padded width: placed by DTensor's strategies at the padded size,
    the width stays split (one all-reduce, after the row split); outputs equal the original's."""
    torch.manual_seed(0)
    _split(PaddedTokens(), ws, ("up.weight",), ("down.weight",), one_all_reduce=True)


@pytest.mark.parametrize("ws,normed", [(3, False), (5, False), (3, True)])
def test_gate_of_merged_heads_is_padded_by_heads(ws: int, normed: bool) -> None:
    """A gate multiplying attention's merged heads (normalised first or not) is cut by the same whole heads (4 heads
    at 3 and 5 ranks, padded): before, its own padding by features met the heads' and both projections were
    replicated, warned."""
    torch.manual_seed(0)
    sm = _split(GatedAttention(normed), ws)
    assert sm.plan.parameters["gate.weight"].local_shape == sm.plan.parameters["qkv.0.weight"].local_shape
    assert sm.plan.parameters["gate.weight"].local_shape[0] == -(-4 // ws) * 8


@pytest.mark.parametrize("ws", [3, 5])
def test_depthwise_convolution_pads_its_channels(ws: int) -> None:
    """32 channels at 3 and 5 ranks: a depthwise convolution of a whole input takes a zero-padded block of the
    channels (a local slice) and its kernel cut alike, the projection after it a row split; before, the
    convolution was kept whole with a warning that the groups do not divide."""
    torch.manual_seed(0)
    sm = _split(ShortConv(), ws, row=("down.weight",))
    assert sm.plan.parameters["conv.weight"].local_shape == (-(-32 // ws), 1, 3)


@pytest.mark.parametrize("ws", [2, 3])
def test_view_as_the_heads_keeps_them_split(ws: int) -> None:
    """view_as takes the layout of the value it reshapes as: the gate is cut by whole heads like the attention
    (4 heads at 2 ranks, and at 3 zero-padded), one all-reduce after the output projection; before, view_as had no
    rule for a padded split at 3 ranks and the projections were replicated, warned."""
    torch.manual_seed(0)
    sm = _split(GateViewAs(), ws, one_all_reduce=True)
    assert sm.plan.parameters["gate.weight"].local_shape == sm.plan.parameters["qkv.0.weight"].local_shape


@pytest.mark.parametrize("ws", [3, 5])
def test_heads_folded_into_rows_and_back(ws: int) -> None:
    """4 heads at 3 and 5 ranks, zero-padded, folded with the batch and tokens into rows and merged back with the
    head dim: the merge keeps the heads split (padded by whole heads), one all-reduce; before, the merge back
    "cut through the padding" and the projections were replicated, warned."""
    torch.manual_seed(0)
    _split(RowsPerHead(), ws, ("q.weight",), ("o.weight",), one_all_reduce=True)


@pytest.mark.parametrize("ws", [3, 5])
def test_whole_bias_beside_heads_folded_with_the_batch(ws: int) -> None:
    """baddbmm (no row in the op table) of heads folded with the batch, zero-padded at 3 and 5 ranks, and a whole ALiBi
    bias as large on that dim: DTensor's strategy asked at the padded size, the bias cut locally by the same heads
    (Bloom's attention); before, the op was left to replicate the projections, warned."""
    torch.manual_seed(0)
    _split(AlibiAttention(), ws, ("qkv.0.weight",), ("o.weight",), one_all_reduce=True)


@pytest.mark.parametrize("ws", [3, 4])
def test_stacked_gate_and_up_stay_split(ws: int) -> None:
    """A projection of gate and up viewed as a dim of 2: each of the 50 features split (zero-padded at 3 and 4
    ranks) along the last dim, the output projection a row split; before, the view "cut through the padding" and
    the MLP was replicated, warned."""
    torch.manual_seed(0)
    sm = _split(StackedGateMLP(), ws, ("fc1.weight",), ("fc2.weight",))
    assert sm.plan.parameters["fc2.weight"].local_shape == (32, -(-50 // ws))


@pytest.mark.parametrize("ws,explicit_pad", [(3, False), (5, False), (3, True)])
def test_heads_found_through_a_cat_and_a_short_convolution(ws: int, explicit_pad: bool) -> None:
    """q, k and v concatenated before a depthwise convolution and split into heads after it: each projection is
    padded by whole heads (4 heads at 3 and 5 ranks), the convolution's channels cut as the three padded segments;
    before, the head size was not found through the cat and the convolution, each projection was padded by
    features, the view to heads cut through the padding and the attention was replicated, warned. With F.pad along
    the tokens first (no row in the op table), DTensor's strategy is asked at the segments' padded size."""
    torch.manual_seed(0)
    sm = _split(ConvLinearAttention(explicit_pad), ws, tuple(f"qkv.{i}.weight" for i in range(3)), ("o.weight",),
                one_all_reduce=True)
    assert sm.plan.parameters["qkv.0.weight"].local_shape == (-(-4 // ws) * 8, 32)
    assert sm.plan.parameters["conv.weight"].local_shape == (3 * -(-4 // ws) * 8, 1, 3)


@pytest.mark.parametrize("ws", [3, 5])
def test_gate_folded_into_rows_of_one_head(ws: int) -> None:
    """A gate projection viewed as rows of one head, (B, T, 4 * 8) -> (B*T*4, 8), beside the heads folded the same
    way: the gate is padded by whole heads like q, k and v (4 heads at 3 and 5 ranks), one all-reduce; before, it
    was padded by features, the fold cut through the padding and the gate was replicated, warned."""
    torch.manual_seed(0)
    sm = _split(GatedHeadNorm(), ws, ("gate.weight", "qkv.0.weight"), ("o.weight",), one_all_reduce=True)
    assert sm.plan.parameters["gate.weight"].local_shape == (-(-4 // ws) * 8, 32)


@pytest.mark.parametrize("ws", [3, 4, 6])
def test_interleaved_pairs_are_split_whole(ws: int) -> None:
    """50 interleaved (gate, up) pairs at 3, 4 and 6 ranks: the projection is split (zero-padded) by whole pairs,
    so each rank's strided entries are its share of the gates and of the ups; before, at 3 ranks the strided
    slice refused the padded split, and at 4 and 6 the blocks held half pairs, replicated, warned."""
    torch.manual_seed(0)
    sm = _split(InterleavedGLU(), ws, ("gate_up.weight",), ("down.weight",), one_all_reduce=True)
    assert sm.plan.parameters["gate_up.weight"].local_shape == (2 * -(-50 // ws), 32)


@pytest.mark.parametrize("ws", [2, 3, 4])
def test_pairs_whose_members_are_cut_into_heads_split_by_pair_heads(ws: int) -> None:
    """Zamba's (hidden, gate) pairs viewed as (B, F / 2, 2, T), each member cut into 3 heads of 16 later (through
    a depthwise convolution for the hidden): the projection's unit is 16 pairs (32 rows), so each rank holds whole
    heads of both members; before, at 2 and 4 ranks the blocks (48 and 24 rows) cut a head, and the projection
    was replicated with a warning."""
    torch.manual_seed(0)
    sm = _split(PairedHeads(), ws, ("in_proj.weight",), ("out_proj.weight",), one_all_reduce=True)
    assert sm.plan.parameters["in_proj.weight"].local_shape == (32 * -(-3 // ws), 32)
    assert sm.plan.parameters["conv.weight"].local_shape == (16 * -(-3 // ws), 1, 3)


@pytest.mark.parametrize("ws", [2, 4, 6])
def test_depthwise_convolution_of_a_whole_input_pads_by_the_heads_it_feeds(ws: int) -> None:
    """A depthwise convolution fed a whole input, its 48 channels cut into 3 heads of 16 later: split (zero-padded)
    by whole heads; before, 24 or 12 channels a rank cut a head (or 8 at 6 ranks), and it was replicated."""
    torch.manual_seed(0)
    sm = _split(WholeInputConvHeads(), ws, ("conv.weight",), ("out_proj.weight",), one_all_reduce=True)
    assert sm.plan.parameters["conv.weight"].local_shape == (16 * -(-3 // ws), 1, 3)


@pytest.mark.parametrize("ws", [3, 4, 6])
@pytest.mark.parametrize("grouped", [False, True], ids=["summed", "grouped"])
def test_experts_cut_into_heads_are_padded_by_heads(ws: int, grouped: bool) -> None:
    """Experts picked out of one 3-D weight whose outputs are cut into 2 heads of 16 (summed, or joined by token and
    put back in order by an index_add): the experts' rows split by whole heads (zero-padded: one head a rank);
    before, 11, 8 or 6 rows a rank cut a head and the experts were replicated with a warning."""
    torch.manual_seed(0)
    sm = _split(ExpertHeads(grouped), ws, ("w",), ("o.weight",), one_all_reduce=True)
    assert sm.plan.parameters["w"].local_shape == (4, 16, 32)


@pytest.mark.parametrize("ws", [2, 3])
def test_query_heads_in_slots_meet_repeated_key_heads(ws: int) -> None:
    """Query heads viewed from (B, T, k, h * d) as k slots of h heads (a reshape's outer blocks), keys and values
    repeated k times along their heads (a repeat's copies): the two lay the heads out alike, so attention takes
    them as they are, and its output viewed back as (B, T, k, h * d) stays split; before, at 3 ranks (heads
    zero-padded), attention took the two for different layouts and the projections were replicated with a
    warning."""
    torch.manual_seed(0)
    sm = _split(SlotHeads(), ws, ("q.weight", "kv.weight"), ("o.weight",), one_all_reduce=True)
    assert sm.plan.parameters["q.weight"].local_shape == (8, 32)


@pytest.mark.parametrize("ws", [3, 6])
def test_std_over_a_padded_split_merges_moments(ws: int) -> None:
    """A std over 100 features at 3 and 6 ranks, zero-padded: each rank's moments over its real entries merged with
    their counts (the padding left out), so the projections stay split; outputs and three SGD steps equal the
    original's; before, the std refused the padded split and the MLP was replicated, warned."""
    torch.manual_seed(0)
    model = SparseActivationMLP()
    sm = _split(model, ws, ("up.weight",), ("down.weight",))
    xs = [torch.randn(2, 6, 32) for _ in range(3)]
    want = sgd_losses(copy.deepcopy(model).train(), xs, lr=0.1)
    for losses in tpcompile.simulate_ranks(ws, lambda r: sgd_losses(sm.rank(r).train(), xs, lr=0.1)):
        assert losses == pytest.approx(want, rel=1e-4, abs=1e-6)


def test_mean_over_a_gate_times_a_whole_value() -> None:
    """20 features at 3 ranks: sigmoid(projection) times a whole value is zero in the padding (the whole factor is
    cut with zeros), so the written-out norm's mean sums the ranks' sums, no warning; before, the mean refused the
    padding and the projection was replicated, warned."""
    torch.manual_seed(0)
    _split(GateTimesWhole(), 3, ("a.weight",), ("down.weight",))


@pytest.mark.parametrize("ws", [3, 6])
def test_max_min_and_logsumexp_over_a_padded_vocabulary(ws: int) -> None:
    """log-sum-exp, max and min over 100 logits at 3 and 6 ranks, zero-padded: each rank fills its padding with what
    never wins (-inf for the max and the log-sum-exp, +inf for the min) before its local reduction, so the head
    stays split, no warning, and the outputs equal the original's (a zero padding would give max 0, which every
    logit is below); before, the reductions refused the padding and the head was replicated, warned."""
    torch.manual_seed(0)
    model = LogitStats()
    sm = _split(model, ws, ("head.weight",))
    assert sm.plan.parameters["head.weight"].local_shape == (-(-100 // ws), 32)
    xs = [torch.randn(2, 6, 32) for _ in range(3)]
    want = sgd_losses(copy.deepcopy(model).train(), xs, lr=0.1)
    for losses in tpcompile.simulate_ranks(ws, lambda r: sgd_losses(sm.rank(r).train(), xs, lr=0.1)):
        assert losses == pytest.approx(want, rel=1e-4, abs=1e-6)


def test_mean_over_a_pending_sum_plus_a_padded_split() -> None:
    """20 features at 3 ranks: embeddings (a pending sum over the vocabulary split) plus a padded projection are
    zero in the padding (the reduced sum is cut with zeros there), so the written-out norm's mean sums the ranks'
    sums; before, the mean refused the padding and the projection was replicated, warned."""
    torch.manual_seed(0)
    model = EmbeddingPlusProjection()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, 3, example_inputs=(torch.randint(0, 64, (2, 5)),))
    assert [str(w.message) for w in caught if issubclass(w.category, tpcompile.TPCompileWarning)] == []
    roles = {n: p.role for n, p in sm.plan.parameters.items()}
    assert roles["a.weight"] == "column" and roles["down.weight"] == "row", roles
    ids = torch.randint(0, 64, (3, 7))
    with torch.no_grad():
        for out in tpcompile.simulate(sm, ids):
            torch.testing.assert_close(out, model(ids), atol=1e-5, rtol=1e-4)


def _on_gloo(rank: int) -> dict:
    """On one of 3 gloo processes: each model above parallelized, its output against the original's; and SGD steps of
    the LayerNorm'd MLP and the differential attention against one process's."""
    out = _parallel_diffs((NormedMLP, SubNormAttention, GatedAttention, GateViewAs, RowsPerHead, AlibiAttention,
                           StackedGateMLP, ShortConv, PaddedTokens, ConvLinearAttention, GatedHeadNorm, InterleavedGLU,
                           SparseActivationMLP, GateTimesWhole, LogitStats, DiffAttention, PairedHeads,
                           WholeInputConvHeads, Recurrent, ExpertHeads, SlotHeads))
    torch.manual_seed(0)
    model = EmbeddingPlusProjection()
    gm = tpcompile.parallelize(model, example_inputs=(torch.randint(0, 64, (2, 5)),))
    ids = torch.randint(0, 64, (3, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out["EmbeddingPlusProjection"] = float((gm(ids) - model(ids)).abs().max())
    model = build_moe(layout="grouped")  # experts joined by token, gate | up in padded segments
    gm = tpcompile.parallelize(model, example_inputs=(torch.randint(0, 64, (2, 8)),))
    with torch.no_grad():
        out["grouped MoE"] = float((gm(ids) - model(ids)).abs().max())
    for cls in (NormedMLP, DiffAttention):
        torch.manual_seed(0)
        model = cls()
        xs = [torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(i)) for i in range(3)]
        want = sgd_losses(copy.deepcopy(model).train(), xs, lr=0.1)
        got = sgd_losses(tpcompile.parallelize(model, example_inputs=(torch.randn(2, 5, 32),)).train(), xs, lr=0.1)
        out[f"sgd {cls.__name__}"] = loss_gap(got, want)
    return out


@pytest.mark.gloo
def test_padded_models_on_three_processes() -> None:
    """tpcompile.parallelize on 3 gloo processes for every model above (widths, heads and channels the world size
    does not divide) and the MoE of experts joined by token (tests/moe_models.py, `grouped`): outputs equal the
    original's, and three SGD steps through the padded LayerNorm and the differential attention's halves of heads
    too."""
    for rank, diffs in enumerate(launch(3, _on_gloo, timeout=300)):
        assert len(diffs) == 25 and max(diffs.values()) < 1e-4, (rank, diffs)
