"""A kv group's query heads split among the ranks sharing its kv head, the group zero-padded (`Shard.cuts`): kv heads
fewer than the ranks, dividing them, and groups the sharing ranks do not divide (Qwen2-7B's 28 heads on 4 kv heads
at 8 ranks). Each rank holds ceil(group / sharing ranks) query heads, not a whole group."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpcompile
import tpcompile.ops.rng as rng
from tpcompile.placement import ParamSlice, rank_pieces
from tpcompile.sharding_rules.group_cuts import group_cuts
from tpcompile.report.plan_table import split_text

from test_uneven_heads import Attention, _exact, _net, _shard

HEAD = 4  # _net's head size here


@pytest.mark.parametrize("heads, kv, ws", [(12, 4, 8), (28, 4, 8), (6, 2, 4), (10, 2, 4), (14, 2, 8)])
def test_query_heads_split_within_their_kv_groups(heads: int, kv: int, ws: int) -> None:
    """Query and output projections hold ceil(group / sharing ranks) heads a rank (a whole group before), the key and
    value projections one kv head a rank in pieces, no warning, two all-reduces a block, exact forward on another
    batch and length, and gradients."""
    model = _net(heads, kv, head_dim=HEAD, width=40)
    sm, warned = _shard(model, ws)
    assert not warned, [str(w.message) for w in warned]
    share, group = ws // kv, heads // kv
    per_rank = -(-group // share) * HEAD
    q, k = sm.plan.parameters["blocks.0.attn.q.weight"], sm.plan.parameters["blocks.0.attn.k.weight"]
    o = sm.plan.parameters["blocks.0.attn.o.weight"]
    assert (q.role, q.local_shape, q.cuts) == ("column", (per_rank, 40), group_cuts(kv, group * HEAD, HEAD, share, ws))
    assert (o.role, o.local_shape, o.cuts) == ("row", (40, per_rank), q.cuts)
    assert (k.role, k.local_shape, k.pieces) == ("column", (HEAD, 40), kv)
    assert sorted(op for op, _ in sm.collectives()) == ["all_reduce"] * 4
    _exact(model, sm, torch.randn(3, 13, 40), torch.randn(2, 9, 40))


@pytest.mark.parametrize("heads, kv, ws, holders", [(4, 2, 5, (3, 2)), (8, 2, 5, (3, 2)), (4, 2, 7, (4, 3)),
                                                     (10, 2, 7, (4, 3))])
def test_kv_heads_the_ranks_do_not_divide_are_held_by_runs_of_ranks(heads: int, kv: int, ws: int,
                                                                  holders: tuple) -> None:
    """2 kv heads at 5 (or 7) ranks: kv head 0 held by the first ceil(ws / 2) ranks, kv head 1 by the rest, each
    group's query heads cut among its holders (a rank with none of them holds a zero head): every rank holds
    ceil(group / holders) query heads and one kv head, as a split balanced by heads does (padded by whole groups
    before: 2 query heads and 1 kv head a rank on 2 ranks, the others zeros). No warning, two all-reduces a block,
    exact forward and gradients on another batch and length."""
    model = _net(heads, kv, head_dim=HEAD, width=40)
    sm, warned = _shard(model, ws)
    assert not warned, [str(w.message) for w in warned]
    group, share = heads // kv, holders[0]
    q, k = sm.plan.parameters["blocks.0.attn.q.weight"], sm.plan.parameters["blocks.0.attn.k.weight"]
    o = sm.plan.parameters["blocks.0.attn.o.weight"]
    assert (q.role, q.local_shape) == ("column", (-(-heads // ws) * HEAD, 40))
    assert q.cuts == group_cuts(kv, group * HEAD, HEAD, share, ws) and o.cuts == q.cuts
    assert (k.role, k.local_shape, k.pieces) == ("column", (HEAD, 40), kv)
    kv_of = [[a // HEAD for a, _, _ in rank_pieces(k.slice(), kv * HEAD, r, ws)] for r in range(ws)]
    assert kv_of == [[0]] * holders[0] + [[1]] * holders[1]
    assert split_text(k) == f"column@0 2 pieces ranks 0-{holders[0] - 1}|{holders[0]}-{ws - 1}"  # `tpcompile plan`
    held = [rank_pieces(q.slice(), heads * HEAD, r, ws) for r in range(ws)]
    assert sorted(i for runs in held for a, _, n in runs for i in range(a, a + n)) == list(range(heads * HEAD))
    assert all(a // HEAD // group == kv_of[r][0] for r in range(ws) for a, _, _ in held[r])  # with its kv head
    assert sorted(op for op, _ in sm.collectives()) == ["all_reduce"] * 4
    _exact(model, sm, torch.randn(3, 13, 40), torch.randn(2, 9, 40))


@pytest.mark.parametrize("heads, kv, ws", [(6, 2, 5), (12, 2, 5), (8, 2, 7)])
def test_the_last_holders_fewer_ranks_set_every_ranks_share(heads: int, kv: int, ws: int) -> None:
    """6 heads on 2 kv heads at 5 ranks: the 2 ranks holding kv head 1 need its 3 query heads at 2 a rank, so every
    rank holds 2 (ranks 0-2 hold kv head 0's 3 as 2 | 1 | zeros), one kv head a rank: 2 + 2 + 1 + 1 heads a rank
    against whole groups' 3 + 3 + 1 + 1 (before: padded by whole groups, the last ranks could not hold their group
    at the first ranks' 1 a rank). 12 on 2 at 5 (3 a rank, against kv-head replication's 3 + 3 + 2 + 2), 8 on 2
    at 7 (ranks 0-3 and 4-6: 2 a rank, against 2 + 2 + 2 + 2). No warning, exact forward and gradients."""
    model = _net(heads, kv, head_dim=HEAD, width=40)
    sm, warned = _shard(model, ws)
    assert not warned, [str(w.message) for w in warned]
    share, group = -(-ws // kv), heads // kv
    per = -(-group // (ws - (kv - 1) * share))
    q, k = sm.plan.parameters["blocks.0.attn.q.weight"], sm.plan.parameters["blocks.0.attn.k.weight"]
    assert (q.local_shape, q.cuts) == ((per * HEAD, 40), group_cuts(kv, group * HEAD, HEAD, share, ws))
    assert (k.local_shape, k.pieces) == ((HEAD, 40), kv)
    held = [rank_pieces(q.slice(), heads * HEAD, r, ws) for r in range(ws)]
    assert sorted(i for runs in held for a, _, n in runs for i in range(a, a + n)) == list(range(heads * HEAD))
    assert all(a // HEAD // group == r // share for r in range(ws) for a, _, _ in held[r])  # with its kv head
    _exact(model, sm, torch.randn(3, 13, 40), torch.randn(2, 9, 40))


def test_every_query_head_is_held_once_and_the_plan_shows_each_ranks_part() -> None:
    """12 heads on 4 kv heads at 8 ranks: ranks 2k and 2k + 1 hold heads 3k, 3k + 1 and 3k + 2 (and a zero head);
    every row of the query weight is on exactly one rank, and `tpcompile plan` says how much on each (rows, and heads
    of 4)."""
    sm, _ = _shard(_net(12, 4, head_dim=HEAD, width=40), 8)
    q = sm.plan.parameters["blocks.0.attn.q.weight"]
    held = [[(a, n) for a, _, n in rank_pieces(q.slice(), 48, r, 8)] for r in range(8)]
    assert held[:4] == [[(0, 8)], [(8, 4)], [(12, 8)], [(20, 4)]]
    rows = sorted(i for runs in held for a, n in runs for i in range(a, a + n))
    assert rows == list(range(48))
    assert split_text(q) == "column@0 12|12|12|12 cut 8|4|8|4|8|4|8|4 heads 2|1|2|1|2|1|2|1"
    assert "S(1|3:2.1~4+3:2.1~4+3:2.1~4+3:2.1~4)" in {str(sm.decisions.placement(n)) for n in sm.captured.graph.nodes}


def test_merged_state_dict_is_the_model_s() -> None:
    """Every rank's slices put back together (checkpoint/merge.py) give the original parameters."""
    model = _net(12, 4, head_dim=HEAD, width=40)
    sm, _ = _shard(model, 8)
    merged = sm.merge_state_dicts([sm.rank(r).state_dict() for r in range(8)])
    for name, t in model.state_dict().items():
        torch.testing.assert_close(merged[name], t, atol=0, rtol=0)


def test_explicit_cuts_are_verified() -> None:
    """A cut whose pieces overlap, give the ranks different sizes, or whose count does not divide the ranks, is refused
    by the verifier; pieces each shared by several ranks are a cut too."""
    from tpcompile.passes.verify_plan import check_tiling
    good = ParamSlice(0, (12, 12), cuts=group_cuts(2, 12, 4, 2, 4))
    check_tiling("q.weight", (24, 8), good, 4)
    overlap = ParamSlice(0, (12, 12), cuts=((0, 8, 16, 16, 16), (0, 0, 4, 8, 16)))
    with pytest.raises(tpcompile.TPCompileError, match="different sizes|overlap"):
        check_tiling("q.weight", (24, 8), overlap, 4)
    check_tiling("q.weight", (24, 8), ParamSlice(0, (12, 12), cuts=((0, 8, 16), (0, 8, 16))), 4)  # 2 pieces, shared
    with pytest.raises(tpcompile.TPCompileError, match="do not fit"):  # 3 pieces do not divide 4 ranks
        check_tiling("q.weight", (24, 8), ParamSlice(0, (12, 12), cuts=((0, 4, 8, 12),) * 2), 4)


def test_hugging_face_attention_dropout_masks_equal_world_size_one() -> None:
    """Llama with 12 heads on 4 kv heads and attention dropout at 8 ranks: each rank's dropout masks are its part of
    the unsharded masks (the heads' positions read through the explicit cuts), so the output equals ws 1's."""
    import hf_models
    arch = next(a for a in hf_models.ALL_ARCHS if a.name == "llama")
    model = hf_models.build(arch, num_attention_heads=12, num_key_value_heads=4, hidden_size=48,
                            attention_dropout=0.3, num_hidden_layers=1).train()
    kwargs = hf_models.inputs(arch, 2, 8)
    outs = {}
    for ws in (1, 8):
        with warnings.catch_warnings():
            warnings.simplefilter("error", tpcompile.TPCompileWarning)
            sm = tpcompile.shard(model, ws, example_kwargs=kwargs)
        if ws == 8:
            assert sm.plan.parameters["model.layers.0.self_attn.q_proj.weight"].slice().rank_cuts
        rng.seed(3)
        outs[ws] = [o.logits for o in tpcompile.simulate(sm, **kwargs)]
    for out in outs[8]:
        torch.testing.assert_close(out, outs[1][0], atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        assert (model.eval()(**kwargs).logits - outs[1][0]).abs().max() > 1e-3  # the masks really drop


def test_generation_splits_the_cache_by_kv_heads() -> None:
    """Greedy generation of a Llama with 12 heads on 4 kv heads at 8 ranks: HF's tokens on every rank, and each rank
    holds one kv head of the cache (a quarter of it), not a whole group of padded heads."""
    from test_generate import greedy_llama

    gen = greedy_llama(8, 12, hidden_size=48, intermediate_size=64, num_attention_heads=12, num_key_value_heads=4)
    assert max(gen.cache_bytes(r) for r in range(8)) == gen.unsharded_cache_bytes // 4


def test_a_whole_checkpoint_loads_into_the_cut_ranks(tmp_path) -> None:
    """A checkpoint of the unsharded model (torch's DCP) read by each of 8 ranks: every rank takes its query heads
    through the cuts' chunks, and the ranks compute the checkpointed model."""
    import torch.distributed.checkpoint as stock_dcp

    from tpcompile import dcp

    model = _net(12, 4, head_dim=HEAD, width=40)
    stock_dcp.save(model.state_dict(), checkpoint_id=str(tmp_path), no_dist=True)
    torch.manual_seed(7)
    other = type(model)(12, 4, head_dim=HEAD, width=40).eval()
    sm, _ = _shard(other, 8)
    ranks = [sm.rank(r) for r in range(8)]
    for r, gm in enumerate(ranks):
        dcp.load(gm, tmp_path, sharded=sm, rank=r, no_dist=True)
    x = torch.randn(2, 7, 40)
    with torch.no_grad():
        want = model(x)
        assert (other(x) - want).abs().max() > 1e-3
        for out in tpcompile.simulate_ranks(8, lambda r: ranks[r](x)):
            torch.testing.assert_close(out, want, atol=1e-5, rtol=0)


class GatedHeads(Attention):
    """Attention whose heads are each scaled by a gate of their own, a (heads, 1, 1) parameter."""

    def __init__(self, *args: int) -> None:
        super().__init__(*args)
        self.gate = nn.Parameter(torch.randn(self.heads, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.k, self.v))
        rep = self.heads // self.kv_heads
        k, v = (a[:, :, None].expand(b, self.kv_heads, rep, t, self.head_dim).reshape(b, self.heads, t, self.head_dim)
                for a in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True) * self.gate
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


def test_a_whole_per_head_value_is_cut_like_the_heads() -> None:
    """A per-head gate, whole on every rank, meets heads split within their groups: each rank cuts its heads'
    gates (its zero head's too) locally, no collective in forward, exact forward and gradients."""
    torch.manual_seed(0)
    model = GatedHeads(40, 12, 4, HEAD).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, 8, example_inputs=(torch.randn(2, 8, 40),))
    assert sm.plan.parameters["q.weight"].slice().rank_cuts and sm.plan.parameters["gate"].dim is None
    assert [op for op, _ in sm.collectives()] == ["all_reduce"]
    _exact(model, sm, torch.randn(2, 11, 40), torch.randn(2, 7, 40))


class WholeNormed(Attention):
    """OLMoE's attention: the query and key projections normed over all their features before the view to heads."""

    def __init__(self, *args: int) -> None:
        super().__init__(*args)
        self.qn, self.kn = nn.RMSNorm(self.heads * self.head_dim), nn.RMSNorm(self.kv_heads * self.head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.qn(self.q(x)).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.kn(self.k(x)).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        rep = self.heads // self.kv_heads
        k, v = (a[:, :, None].expand(b, self.kv_heads, rep, t, self.head_dim).reshape(b, self.heads, t, self.head_dim)
                for a in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


def test_a_norm_over_a_whole_projection_gives_the_group_cut_up() -> None:
    """A norm over all the key features cannot read kv heads in pieces: propagation gives the group cut up for
    whole groups (what it would have chosen without it), not a replication: no warning, exact, one kv head and
    one padded group a rank."""
    torch.manual_seed(0)
    model = WholeNormed(40, 12, 4, HEAD).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, 8, example_inputs=(torch.randn(2, 8, 40),))
    q, k = sm.plan.parameters["q.weight"], sm.plan.parameters["k.weight"]
    assert (q.slice().rank_cuts, q.padded, q.local_shape) == (False, 96, (12, 40))  # 4 groups of 3 heads padded to 8
    assert (k.pieces, k.local_shape) == (None, (4, 40)) and not sm.plan.replicated
    _exact(model, sm, torch.randn(2, 11, 40), torch.randn(2, 7, 40))


def test_the_zero_heads_get_no_gradient() -> None:
    """A rank's zero query head reads a copy of its kv head: the copies at padded places are zeros, so the zero
    head's output is zero and the padded rows of the query weight and columns of the output weight get exactly
    zero gradient (they stay zero under any optimizer: training equals one process step after step)."""
    model = _net(12, 4, head_dim=HEAD, width=40)
    sm, _ = _shard(model, 8)
    ranks = [sm.rank(r) for r in range(8)]
    x = torch.randn(2, 9, 40)

    def backward(r: int) -> dict:
        ranks[r](x).square().sum().backward()
        return {n: p.grad.clone() for n, p in ranks[r].named_parameters()}

    grads = tpcompile.simulate_ranks(8, backward)
    for r in range(1, 8, 2):  # the second rank of each kv head: 1 real head, 1 zero head
        assert grads[r]["blocks.0.attn.q.weight"][HEAD:].abs().max() == 0
        assert grads[r]["blocks.0.attn.o.weight"][:, HEAD:].abs().max() == 0
        assert grads[r]["blocks.0.attn.o.weight"][:, :HEAD].abs().max() > 0


@pytest.mark.gloo
@pytest.mark.parametrize("model, tp, heads, bound", [("llama", 4, 6, 0.35), ("phi3", 4, 6, 0.4),
                                                     ("llama", 5, 4, 0.3), ("llama", 5, 6, 0.3)])
def test_training_under_torchrun_equals_one_process(model: str, tp: int, heads: int, bound: float) -> None:
    """examples/train_hybrid.py at tp 4 under torchrun (4 gloo processes) on a Llama with 6 heads on 2 kv heads
    (groups of 3 cut 2 | 1 between the 2 ranks sharing each kv head), or a Phi-3 (one qkv_proj, cut alike), and at
    tp 5 on a Llama with 4 or 6 heads on 2 kv heads (held by ranks 0-2 and 3-4; 6 heads: 2 a rank, as the last 2
    ranks need): the single process's losses, step after step, and each rank under `bound` of the parameters (the
    Llama's 0.32 at 4: each kv head is held by 2 ranks, the groups padded)."""
    from hybrid_matrix import TOLERANCE, layout_args, run_example, worst_relative

    args = ["--model", f"hf:{model}", "--config", f"num_attention_heads={heads}", "--config", "num_key_value_heads=2",
            "--config", "hidden_size=24", "--config", "intermediate_size=40", "--layers", "2",
            "--inputs", "4x16:long", "--steps", "3", "--json"]
    out = run_example([*layout_args(1, tp, 1), *args], nproc=tp)
    ref = run_example(["--dp", "1", "--tp", "1", "--pp", "1", *args])
    assert worst_relative(out["losses"], ref["losses"]) < TOLERANCE, (out["losses"], ref["losses"])
    assert max(out["param_bytes_per_rank"]) < bound * out["model_param_bytes"]


def test_sequence_parallel_keeps_the_group_cut() -> None:
    """With sequence parallelism the tokens are split outside the attention and the MLP: the heads stay cut within
    their groups, and the forward and gradients are exact on another batch and length."""
    model = _net(12, 4, head_dim=HEAD, width=40)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, 8, example_inputs=(torch.randn(2, 8, 40),), sequence_parallel=True)
    assert sm.plan.parameters["blocks.0.attn.q.weight"].slice().rank_cuts
    assert sorted(op for op, _ in sm.collectives()) == ["all_gather"] * 3 + ["all_gather_replicated"] \
        + ["reduce_scatter"] * 4
    _exact(model, sm, torch.randn(2, 16, 40), torch.randn(2, 8, 40))


class UnflattenedHeads(Attention):
    """Attention whose projections are cut into heads by `unflatten` rather than `view`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for p in (self.q, self.k, self.v))
        q = q.unflatten(1, (self.heads, 1)).flatten(1, 2)  # (heads, 1) and back: the cut dim split and merged
        rep = self.heads // self.kv_heads
        k, v = (a[:, :, None].expand(b, self.kv_heads, rep, t, self.head_dim).reshape(b, self.heads, t, self.head_dim)
                for a in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).flatten(2))


def test_unflatten_of_the_cut_heads_takes_each_rank_s_size() -> None:
    """`unflatten` of the heads dim gets its size literal from the cuts (2 heads a rank, not 12 // 8), exact."""
    torch.manual_seed(0)
    model = UnflattenedHeads(40, 12, 4, HEAD).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, 8, example_inputs=(torch.randn(2, 8, 40),))
    assert sm.plan.parameters["q.weight"].slice().rank_cuts
    _exact(model, sm, torch.randn(2, 11, 40), torch.randn(2, 7, 40))
