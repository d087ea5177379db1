"""More ranks than heads (4 at 6 or 8 ranks) or kv heads (2 at 6 or 8): heads in pieces shared by ranks go one to a
rank when what reads them needs it, a kv group's query heads cut among the ranks sharing its kv head meet reductions,
and attention written out, a gate or a padding of the tokens meet grouped heads; a linear attention's value heads
cut among the ranks sharing their repeated key head; a fresh tensor filled with heads in pieces; one group whole on
every rank against heads in pieces (tests/padded_models.py, tests/group_models.py).
"""
from __future__ import annotations

import copy

import pytest
import torch

import tpcompile
from tpcompile.runtime import launch

from group_models import (EagerGroupAttention, GatedGroupAttention, GroupedKeyHeads, GroupPadTokens, GroupSubNorm,
                          KeyRepeatLinearAttention, OneGroupHeads, RepeatedMultiQuery, SharedRopeKeys)
from padded_checks import equal, parallel_diffs, shard, split
from padded_models import (AlibiAttention, GatedAttention, GatedHeadNorm, GateViewAs, PairedHeads, RowsPerHead,
                           SlotHeads)


FEWER_HEADS = [(RowsPerHead, 8), (AlibiAttention, 8), (GatedAttention, 8), (GatedHeadNorm, 8), (GateViewAs, 8),
               (PairedHeads, 6), (SlotHeads, 6), (SlotHeads, 8)]


@pytest.mark.parametrize("make,ws", FEWER_HEADS, ids=[f"{m.__name__}-{ws}" for m, ws in FEWER_HEADS])
def test_heads_fewer_than_ranks_go_one_to_a_rank(make: type, ws: int) -> None:
    """Fewer heads than ranks (4 at 8, 2 at 6, 3 pairs x heads at 6) start in pieces each shared by several ranks;
    a row split reading them (it would count a piece once per rank holding it), a gate padded by heads, a reshape
    as a padded value, a repeat along the heads and an attention whose keys go one to a rank each ask for them one
    to a rank, zero-padded, instead of replicating: no warning, every parameter split at 2 ranks split here too,
    none in shared pieces, outputs equal."""
    torch.manual_seed(0)
    model = make()
    sm, warned = shard(model, ws)
    assert warned == []
    split = {n for n, p in shard(make(), 2)[0].plan.parameters.items() if p.dim is not None}
    plans = sm.plan.parameters
    assert split and {n for n, p in plans.items() if p.dim is not None} == split
    assert all(p.pieces is None and p.seg_pieces is None for p in plans.values()), plans
    equal(model, sm)


@pytest.mark.parametrize("ws", [6, 8])
@pytest.mark.parametrize("reduce", ["mean", "sum", "amax", "norm", "var"])
def test_reductions_over_kv_groups_cut_among_ranks(reduce: str, ws: int) -> None:
    """2 kv heads at 6 and 8 ranks: each group's 2 query heads cut among the 3 or 4 ranks sharing its kv head, the
    last ranks holding zeros (an attention of zero query heads over the real keys is not zero). A mean or sum over
    the merged heads zeroes that padding and scales by the real size (it divided by the world size: wrong by 8%
    at 6 ranks, without a word); a max, a norm or a variance, which cannot be merged so, takes the whole groups
    zero-padded instead. No warning, equal; the mean and sum keep the cut (a quarter of q's rows at 8 ranks)."""
    torch.manual_seed(0)
    model = GroupSubNorm(reduce)
    sm, warned = shard(model, ws)
    assert warned == []
    equal(model, sm)
    if reduce in ("mean", "sum"):
        assert sm.plan.parameters["q.weight"].local_shape == (8, 32)
        assert sm.plan.parameters["q.weight"].cuts is not None


@pytest.mark.parametrize("ws", [3, 6, 8])
@pytest.mark.parametrize("sinks", [False, True])
def test_attention_written_out_is_split_by_kv_groups(sinks: bool, ws: int) -> None:
    """Grouped-query attention written out (q @ k^T soft-capped, a mask, a softmax, @ v; Gemma-2's eager path) with
    2 kv heads at 3, 6 and 8 ranks is found as an attention, as scaled_dot_product_attention is, its scores read by
    a logsumexp too or not (attention sinks, GraniteMoe's): its query heads split by kv group (q and o hold a quarter
    of their rows at 6 and 8 ranks, a half at 3), no warning (at 6 and 8 the projections were replicated), equal."""
    torch.manual_seed(0)
    model = EagerGroupAttention(sinks)
    sm = split(model, ws, column=("q.weight", "k.weight", "v.weight"), row=("o.weight",), one_all_reduce=True)
    assert sm.plan.parameters["q.weight"].local_shape == ((16, 32) if ws == 3 else (8, 32))


@pytest.mark.parametrize("ws", [2, 4, 5, 6])
def test_padding_the_tokens_of_one_group_whole_on_every_rank(ws: int) -> None:
    """Mamba-2's one group of B, whole on every rank and repeated for 4 heads, padded along the tokens (F.pad, a
    row of the op table: `layout_ops.pad`): the padding touches no split dim and keeps the layout; at 5 and 6 ranks,
    more than the 4 heads, DTensor's strategy replicated it (a dim of fewer entries than ranks) and with it the
    group's projection, with a warning."""
    torch.manual_seed(0)
    split(GroupPadTokens(), ws, column=("x.weight", "b.weight"), row=("o.weight",), one_all_reduce=True)


@pytest.mark.parametrize("ws", [6, 8])
def test_key_heads_repeated_for_value_heads_go_one_to_a_rank(ws: int) -> None:
    """2 key-head groups (query and key head, 2 value heads each) at 6 and 8 ranks: in 2 pieces each shared by 3
    or 4 ranks, the query and key heads repeated twice cannot give each sharing rank its own; the groups go one to
    a rank, zero-padded, instead (the projection was replicated with a warning): the largest rank holds one group,
    as a split balanced by groups does."""
    torch.manual_seed(0)
    sm = split(GroupedKeyHeads(), ws, column=("qkv.weight",), row=("o.weight",), one_all_reduce=True)
    assert sm.plan.parameters["qkv.weight"].local_shape == (32, 32)


@pytest.mark.parametrize("ws", [6, 8])
def test_gate_of_heads_split_by_whole_groups_takes_their_unit(ws: int) -> None:
    """2 kv heads at 6 and 8 ranks, q and k normalised over their whole projections (no kv heads in pieces): the
    query heads go by whole kv groups, 2 heads a rank, and so does the sigmoid gate multiplying the merged heads
    (padded by one head it met them laid out otherwise, and everything was replicated with a warning). The two
    norms' statistics are gathered, the output projection all-reduced."""
    torch.manual_seed(0)
    sm = split(GatedGroupAttention(), ws, column=("q.weight", "k.weight", "v.weight", "gate.weight"),
                row=("o.weight",))
    assert sm.plan.parameters["gate.weight"].local_shape == sm.plan.parameters["q.weight"].local_shape == (16, 32)
    assert sorted(op for op, _ in sm.collectives()) == ["all_gather", "all_gather", "all_reduce"]


@pytest.mark.parametrize("ws", [6, 8])
@pytest.mark.parametrize("layout", ["fused", "joined", "apart"])
def test_key_heads_repeated_cut_their_value_heads_among_the_ranks_sharing_them(layout: str, ws: int) -> None:
    """A linear attention (Qwen3.5's, OLMo-Hybrid's gated delta rule) whose 2 query and key heads are repeated for
    4 value heads, at 6 and 8 ranks: each key head in a piece held by the 3 or 4 ranks sharing it, its 2 value heads
    cut among them (one a rank, zeros past them), and so the step size's, the decay's and the gate's projections, one
    head a rank; the repeats give each rank its share. The projections were replicated with a warning (the repeated
    keys went one group to a rank, the value heads one head to a rank: laid out differently). Gradients equal too."""
    torch.manual_seed(0)
    model = KeyRepeatLinearAttention(layout)
    qkv = ("qkv.weight",) if layout == "fused" else ("q.weight", "k.weight", "v.weight")
    sm = split(model, ws, column=(*qkv, "beta.weight", "decay.weight", "z.weight"), row=("o.weight",),
               one_all_reduce=True)
    plans = sm.plan.parameters
    assert plans["z.weight"].local_shape == (8, 32) and plans["beta.weight"].local_shape == (1, 32)
    assert plans["z.weight"].cuts is not None and plans[qkv[-1]].cuts is not None
    assert all(plans[n].local_shape == ((24, 32) if layout == "fused" else (8, 32)) for n in qkv)
    _gradients_in_double(model, ws)


@pytest.mark.parametrize("ws", [5, 6, 8])
@pytest.mark.parametrize("per_head", [False, True])
def test_gate_of_heads_cut_within_kv_groups_is_cut_with_them(per_head: bool, ws: int) -> None:
    """2 kv heads at 5, 6 and 8 ranks, no norm over a whole projection: each kv head in a piece held by 3 or 4 ranks
    (2 for kv head 1 at 5), its 2 query heads cut among them, and the sigmoid gate of the merged heads cut as they are
    (one head a rank, zeros past them; it was padded by one head, met them laid out otherwise, and the cut was given
    up for whole groups: the largest rank held 2 query heads where 1 would do). `per_head`: the gate viewed as the
    heads before they merge, plus a bias per head (Beam's: view_as refused the cut heads, and the projections were
    replicated with a warning). One all-reduce, no warning, equal."""
    torch.manual_seed(0)
    sm = split(GatedGroupAttention(norms=False, per_head=per_head), ws,
               column=("q.weight", "k.weight", "v.weight", "gate.weight"), row=("o.weight",), one_all_reduce=True)
    plans = sm.plan.parameters
    assert plans["gate.weight"].local_shape == plans["q.weight"].local_shape == (8, 32)
    assert plans["gate.weight"].cuts == plans["q.weight"].cuts is not None


@pytest.mark.parametrize("ws", [3, 5, 6, 8])
def test_one_kv_head_repeated_meets_query_heads_in_pieces(ws: int) -> None:
    """Multi-query attention from one fused q|k|v projection, the one key and value head repeated over the 4 query
    heads (GPTBigCode's): at 8 ranks the query heads in pieces (each held by 2 ranks) met the repeated key and value
    heads, whole on every rank; the attention asked for a plain split of the heads, lined up with neither, and the
    whole attention was kept whole (GPTBigCode at 8 warned). Now the key and value heads are cut locally to the
    query heads' pieces, and the query heads end zero-padded one a rank (2 a rank at 3), as the output projection's
    row split asks. One all-reduce, no warning, equal, gradients too."""
    torch.manual_seed(0)
    model = RepeatedMultiQuery()
    sm = split(model, ws, column=("qkv.weight",), row=("o.weight",), one_all_reduce=True)
    assert sm.plan.parameters["qkv.weight"].local_shape == (-(-4 // ws) * 8 + 16, 32)  # its query heads, k and v
    report = tpcompile.check_gradients(model.train(), sm, torch.randn(2, 7, 32))
    assert report.ok, str(report)


@pytest.mark.parametrize("ws", [3, 4, 6, 8])
def test_fresh_tensor_filled_with_heads_fewer_than_ranks(ws: int) -> None:
    """Multi-head latent attention's keys, 4 heads, written slice by slice into a fresh tensor (new_empty): its own
    features split by heads, the rotary features shared by every head whole. At 8 ranks the heads start in pieces
    each shared by 2 ranks; the fresh tensor takes them so (it was whole, the split write refused, its projection
    replicated with a warning), and the whole features are written into each rank's part; the attention of q, k and
    v alike in pieces is computed by each piece's ranks (the keys and values were kept whole on every rank). No
    warning, equal."""
    torch.manual_seed(0)
    split(SharedRopeKeys(), ws, column=("q.weight", "kv_b.weight"), row=("o.weight",), one_all_reduce=True)


@pytest.mark.parametrize("ws", [4, 6, 8])
def test_one_group_whole_meets_heads_in_pieces(ws: int) -> None:
    """Mamba-2's one group of B and C, whole on every rank and repeated for 4 heads, against the heads in 4 pieces
    each shared by 2 ranks at 8 ranks: each rank cuts its piece from the whole group (it met them laid out
    otherwise, and the projection was replicated with a warning); the norm over the merged heads sums each shared
    piece once per rank holding it, divided by their count; the output projection takes the heads one to a rank,
    the group's segments staying whole. No warning, equal, the gradients equal too."""
    torch.manual_seed(0)
    model = OneGroupHeads()
    sm = split(model, ws, column=("xbc.weight", "z.weight"), row=("o.weight",))
    assert sm.plan.parameters["xbc.weight"].local_shape == (24, 32)
    report = tpcompile.check_gradients(model, sm, torch.randn(2, 7, 32))
    assert report.ok, str(report)


@pytest.mark.parametrize("layout", ["fused", "joined", "apart"])
def test_key_heads_repeated_pad_by_whole_groups_where_the_ranks_do_not_divide_them(layout: str) -> None:
    """The same linear attention at 5 ranks, which do not divide its 2 key heads: the key heads padded one a rank,
    repeated, are 2 heads a rank, the value heads padded one a rank 1; each projection is padded by whole groups
    instead (a key head, or its 2 value heads and their gate, a rank). They met laid out differently and the
    projections were replicated with a warning. Equal, gradients too."""
    torch.manual_seed(0)
    model = KeyRepeatLinearAttention(layout)
    qkv = ("qkv.weight",) if layout == "fused" else ("q.weight", "k.weight", "v.weight")
    sm = split(model, 5, column=(*qkv, "z.weight"), row=("o.weight",), one_all_reduce=True)
    plans = sm.plan.parameters
    assert plans["z.weight"].local_shape == (16, 32) and plans[qkv[-1]].local_shape == (16 if qkv[1:] else 32, 32)
    _gradients_in_double(model, 5)


def _gradients_in_double(model: torch.nn.Module, ws: int) -> None:
    """The model's gradients, sharded at `ws` ranks, equal the original's, checked in float64: in float32 the exp of
    the decays' differences and the normalised keys leave the query and key weights' gradients up to 9e-5 from the
    original's at 5 ranks, over the check's tolerance; in float64 they agree to 1e-13."""
    model = copy.deepcopy(model).double()
    sm = tpcompile.shard(model, ws, example_inputs=(torch.randn(2, 5, 32, dtype=torch.float64),))
    report = tpcompile.check_gradients(model, sm, torch.randn(2, 7, 32, dtype=torch.float64))
    assert report.ok, str(report)


def _on_six(rank: int) -> dict:
    """On one of 6 gloo processes: the models whose heads are fewer than the ranks, output against the original's."""
    return parallel_diffs((PairedHeads, SlotHeads, RowsPerHead, GatedAttention, GroupSubNorm, EagerGroupAttention,
                            GroupPadTokens, GroupedKeyHeads, GatedGroupAttention, KeyRepeatLinearAttention))


@pytest.mark.gloo
def test_heads_fewer_than_ranks_on_six_processes() -> None:
    """tpcompile.parallelize on 6 gloo processes for models with 2, 3 and 4 heads (one to a rank, zero-padded) and
    for 2 kv groups each cut among 3 ranks (a mean over their merged heads; attention written out; a linear
    attention's value heads), and one group whole on every rank padded along the tokens: outputs equal the
    original's on every rank."""
    for rank, diffs in enumerate(launch(6, _on_six, timeout=300)):
        assert len(diffs) == 10 and max(diffs.values()) < 1e-4, (rank, diffs)
