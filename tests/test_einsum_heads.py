"""einsum attention whose heads come from its operands: grouped-query attention written over grouped heads
(`btkgd,bskd->bkgts`), and attention over parameters laid out by heads, packed (3, heads, head_dim, dim) or
separate (heads, head_dim, dim), each followed by an output projection (einsum over a (heads, head_dim, dim)
parameter, or a Linear).

Each model is two pre-norm residual blocks. It shards at world sizes 2 and 4 without a warning, every rank
equals the original on another batch and length, a rank holds at most 1.25 / world size of the parameters,
and each block issues Megatron's minimum: one all-reduce in forward and one of the activations in backward
(kv heads held in pieces add one bucket of their weight gradients). The same einsum layout read as experts
keeps the expert index whole.
"""
from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from hf_models import held_share
from torch import nn

import tpcompile
from tpcompile.ops import collectives
from tpcompile.layouts import within_cut
from tpcompile.placement import Shard, piece_shard
from tpcompile.sharding_rules.contract_readers import REFUSED, TAKEN, WANTED

D, HEADS, HD = 64, 8, 8
BLOCK = re.compile(r"^blocks\.(\d+)")


class GroupedEinsum(nn.Module):
    """Grouped-query attention over grouped heads: q viewed as (B, T, kv heads, group, head_dim)."""

    def __init__(self, kv: int, heads: int = 2 * HEADS) -> None:
        super().__init__()
        self.kv, self.heads = kv, heads
        self.q, self.o = nn.Linear(D, heads * HD), nn.Linear(heads * HD, D)
        self.k, self.v = nn.Linear(D, kv * HD), nn.Linear(D, kv * HD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.kv, self.heads // self.kv, HD)
        k, v = (f(x).view(b, t, self.kv, HD) for f in (self.k, self.v))
        att = (torch.einsum("btkgd,bskd->bkgts", q, k) * HD ** -0.5).softmax(-1)
        return self.o(torch.einsum("bkgts,bskd->btkgd", att, v).reshape(b, t, self.heads * HD))


class _Output(nn.Module):
    """The output projection: einsum over a (heads, head_dim, dim) parameter, or a Linear."""

    def __init__(self, form: str, heads: int = HEADS) -> None:
        super().__init__()
        self.form = form
        if form == "einsum":
            self.w_o = nn.Parameter(torch.randn(heads, HD, D) / (heads * HD) ** 0.5)
        else:
            self.o = nn.Linear(heads * HD, D)

    def project(self, out: torch.Tensor) -> torch.Tensor:  # (B, T, heads, head_dim)
        if self.form == "einsum":
            return torch.einsum("bthe,hed->btd", out, self.w_o)
        return self.o(out.flatten(2))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    att = (torch.einsum("bthe,bshe->bhts", q, k) * HD ** -0.5).softmax(-1)
    return torch.einsum("bhts,bshe->bthe", att, v)


class PackedEinsum(_Output):
    """q, k and v from one packed (3, heads, head_dim, dim) parameter by one einsum, unbound."""

    def __init__(self, form: str) -> None:
        super().__init__(form)
        self.w_qkv = nn.Parameter(torch.randn(3, HEADS, HD, D) / D ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = torch.einsum("btd,shed->sbthe", x, self.w_qkv).unbind(0)
        return self.project(_attend(q, k, v))


class SeparateEinsum(_Output):
    """q, k and v each from a (heads, head_dim, dim) parameter by einsum."""

    def __init__(self, form: str, heads: int = HEADS) -> None:
        super().__init__(form, heads)
        self.wq, self.wk, self.wv = (nn.Parameter(torch.randn(heads, HD, D) / D ** 0.5) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (torch.einsum("btd,hed->bthe", x, w) for w in (self.wq, self.wk, self.wv))
        return self.project(_attend(q, k, v))


class Net(nn.Module):
    """Two pre-norm residual blocks around the given attention."""

    def __init__(self, make: type, *args: object) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.blocks = nn.ModuleList(nn.ModuleDict({"norm": nn.LayerNorm(D), "attn": make(*args)})
                                        for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = x + blk["attn"](blk["norm"](x))
        return x


def _per_block(sm: tpcompile.ShardedModel) -> dict[str, list[str]]:
    """Rank 0's forward collectives by block index ('-' outside the blocks)."""
    out: dict[str, list[str]] = {}
    for op, path in sm.collectives():
        m = BLOCK.match(path)
        out.setdefault(m.group(1) if m else "-", []).append(op)
    return out


def _check(model: nn.Module, ws: int) -> tpcompile.ShardedModel:
    """Shard without a warning; every rank equals the original on (3, 11); held share and one all-reduce
    per block in forward."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, ws, example_inputs=(torch.randn(2, 8, D),))
    x = torch.randn(3, 11, D)
    with torch.no_grad():
        ref = model(x)
        for r, got in enumerate(tpcompile.simulate(sm, x)):
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=0, msg=lambda m: f"ws {ws} rank {r}: {m}")
    assert held_share(model, sm) <= 1.25 / ws, f"ws {ws}: a rank holds {held_share(model, sm):.3f}"
    assert _per_block(sm) == {"0": ["all_reduce"], "1": ["all_reduce"]}, _per_block(sm)
    return sm


def _einsums(sm: tpcompile.ShardedModel) -> dict[str, object]:
    """The placement of each einsum of the first block, by equation."""
    out: dict[str, object] = {}
    for n in sm.captured.graph.nodes:
        if n.target is torch.ops.aten.einsum.default:
            out.setdefault(n.args[0], sm.decisions.placement(n))
    return out


@pytest.mark.parametrize("ws", [2, 4])
def test_grouped_einsum_splits_the_kv_head_index(ws: int) -> None:
    """16 query heads in 2 groups of 8, one per kv head: at 2 ranks the kv-head index is split and the group whole;
    at 4, each kv head is a piece held by 2 ranks and the group is split within it; q/k/v column, o row."""
    sm = _check(Net(GroupedEinsum, 2), ws)
    assert {m: sm.plan.modules[f"blocks.0.attn.{m}"] for m in "qkvo"} == \
        {"q": "column", "k": "column", "v": "column", "o": "row"}
    scores = _einsums(sm)["btkgd,bskd->bkgts"]
    assert scores == (Shard(1) if ws == 2 else piece_shard(1, 2, 2, within=within_cut(8, 2))), scores
    assert sm.plan.parameters["blocks.0.attn.k.weight"].pieces == (None if ws == 2 else 2)


@pytest.mark.parametrize("ws", [2, 4])
def test_multi_query_einsum_keeps_the_one_kv_head_whole(ws: int) -> None:
    """One kv head for all: k and v whole on every rank, the query group index split; equal to the original."""
    model = Net(GroupedEinsum, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, ws, example_inputs=(torch.randn(2, 8, D),))
    x = torch.randn(3, 11, D)
    with torch.no_grad():
        for got in tpcompile.simulate(sm, x):
            torch.testing.assert_close(got, model(x), atol=1e-5, rtol=0)
    assert sm.plan.parameters["blocks.0.attn.q.weight"].local_shape == (2 * HEADS * HD // ws, D)
    assert sm.plan.parameters["blocks.0.attn.k.weight"].local_shape == (HD, D)
    assert _einsums(sm)["btkgd,bskd->bkgts"] == Shard(2)
    assert _per_block(sm) == {"0": ["all_reduce"], "1": ["all_reduce"]}


@pytest.mark.parametrize("form", ["einsum", "linear"])
@pytest.mark.parametrize("ws", [2, 4])
def test_packed_parameter_is_split_by_heads(ws: int, form: str) -> None:
    """(3, heads, head_dim, dim) read by `btd,shed->sbthe`: split on heads (dim 1), neither q|k|v nor
    head_dim; the output projection a row split on heads."""
    sm = _check(Net(PackedEinsum, form), ws)
    qkv = sm.plan.parameters["blocks.0.attn.w_qkv"]
    assert (qkv.role, qkv.dim, qkv.local_shape) == ("column", 1, (3, HEADS // ws, HD, D))
    out = sm.plan.parameters["blocks.0.attn.w_o" if form == "einsum" else "blocks.0.attn.o.weight"]
    assert (out.dim, out.local_shape) == ((0, (HEADS // ws, HD, D)) if form == "einsum" else (1, (D, HEADS * HD // ws)))


@pytest.mark.parametrize("form", ["einsum", "linear"])
@pytest.mark.parametrize("ws", [2, 4])
def test_separate_parameters_are_split_by_heads(ws: int, form: str) -> None:
    """(heads, head_dim, dim) q, k and v parameters: each split on heads (dim 0); the scores split by heads."""
    sm = _check(Net(SeparateEinsum, form), ws)
    for name in ("wq", "wk", "wv"):
        p = sm.plan.parameters[f"blocks.0.attn.{name}"]
        assert (p.role, p.dim, p.local_shape) == ("column", 0, (HEADS // ws, HD, D)), name
    assert _einsums(sm)["bthe,bshe->bhts"] == Shard(1)


@pytest.mark.parametrize("form", ["einsum", "linear"])
def test_heads_fewer_than_ranks_are_padded_not_cut_by_head_dim(form: str) -> None:
    """4 heads of 8 at 8 ranks: q, k and v each split by heads, one a rank and zeros on 4 ranks, as the scores are
    (head_dim, which 8 divides, is summed by q.k; v split by it would not meet the probabilities split by heads);
    no warning, one all-reduce a block, equal to the original."""
    model = Net(SeparateEinsum, form, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, 8, example_inputs=(torch.randn(2, 8, D),))
    for name in ("wq", "wk", "wv"):
        p = sm.plan.parameters[f"blocks.0.attn.{name}"]
        assert (p.role, p.dim, p.local_shape) == ("column", 0, (1, HD, D)), name
    assert _per_block(sm) == {"0": ["all_reduce"], "1": ["all_reduce"]}
    x = torch.randn(3, 11, D)
    with torch.no_grad():
        for got in tpcompile.simulate(sm, x):
            torch.testing.assert_close(got, model(x), atol=1e-5, rtol=0)


def test_readers_choose_the_heads_index() -> None:
    """The packed einsum's readers refuse the q|k|v index (unbound) and head_dim (summed by q.k), want the heads."""
    sm = tpcompile.shard(Net(PackedEinsum, "einsum"), 2, example_inputs=(torch.randn(2, 8, D),))
    spec = next(sm.decisions.rule(n) for n in sm.captured.graph.nodes if n.target is torch.ops.aten.einsum.default)
    assert spec.get("needs") == {"s": REFUSED, "h": WANTED, "e": REFUSED}


class Experts(nn.Module):
    """Every expert on every token by einsum over an (experts, out, dim) parameter, summed by router weights:
    the same equation shape as heads, but the readers sum the expert index against an activation."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(D, 4)
        self.w = nn.Parameter(torch.randn(4, 2 * D, D) / D ** 0.5)
        self.down = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.gelu(torch.einsum("btd,eod->bteo", x, self.w))
        return x + self.down(torch.einsum("bteo,bte->bto", y, self.router(x).softmax(-1)))


@pytest.mark.parametrize("ws", [2, 4])
def test_expert_index_stays_whole(ws: int) -> None:
    """The same layout read as experts (the router kept whole): the expert index refused, the features taken;
    split on them, equal to the original."""
    model = Experts()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, ws, example_inputs=(torch.randn(2, 8, D),), plan={"router": "replicate"})
    spec = next(sm.decisions.rule(n) for n in sm.captured.graph.nodes if n.target is torch.ops.aten.einsum.default)
    assert spec.get("needs") == {"e": REFUSED, "o": TAKEN}
    assert sm.plan.parameters["w"].dim == 1
    x = torch.randn(3, 11, D)
    with torch.no_grad():
        for got in tpcompile.simulate(sm, x):
            torch.testing.assert_close(got, model(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", [(PackedEinsum, "einsum", 2), (GroupedEinsum, 2, 4)], ids=["packed-ws2", "gqa-ws4"])
def test_gradients_match_and_backward_is_one_all_reduce_per_block(case: tuple) -> None:
    """Every rank's parameter gradients are the original's slices; backward issues one all-reduce of the
    activations per block (the input gradient of the column splits), and for kv heads held in pieces one bucket
    summing the pieces' weight gradients over the ranks sharing them."""
    make, arg, ws = case
    model = Net(make, arg)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, ws, example_inputs=(torch.randn(2, 8, D),))
    with collectives.record() as events:
        report = tpcompile.check_gradients(model, sm, torch.randn(3, 11, D))
    assert report.ok, report.verdict()
    backward = [e for e in events if e.phase == "backward" and e.rank == 0]
    activations = [e for e in backward if e.shape == (3, 11, D)]
    assert [e.op for e in activations] == ["all_reduce", "all_reduce"], backward
    assert len(backward) - len(activations) == (1 if make is GroupedEinsum else 0), backward
