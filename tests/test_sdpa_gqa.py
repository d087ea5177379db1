"""Grouped-query attention done by the attention op itself (`scaled_dot_product_attention(..., enable_gqa=True)`,
k and v never repeated in the graph): split at any world size with every rank's query heads reading its own kv heads
(evenly, kv heads in pieces shared by the ranks among which their groups are cut, or zero-padded by whole groups; one
kv head for all whole on every rank), exact forward and gradients, no warning; on real gloo processes too."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpcompile
from tpcompile.placement import Shard, cut_shard, pad_cuts, piece_shard
from tpcompile.runtime.launch import launch
from tpcompile.sharding_rules.gqa import kv_split, reads_own_kv

WIDTH, HEAD = 32, 8


class Attention(nn.Module):
    def __init__(self, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads
        self.q, self.o = nn.Linear(WIDTH, heads * HEAD), nn.Linear(heads * HEAD, WIDTH)
        self.k, self.v = nn.Linear(WIDTH, kv_heads * HEAD), nn.Linear(WIDTH, kv_heads * HEAD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, HEAD).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv_heads, HEAD).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv_heads, HEAD).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Net(nn.Module):
    def __init__(self, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(WIDTH) for _ in range(4))
        self.attns = nn.ModuleList(Attention(heads, kv_heads) for _ in range(2))
        self.ups = nn.ModuleList(nn.Linear(WIDTH, 48) for _ in range(2))
        self.downs = nn.ModuleList(nn.Linear(48, WIDTH) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(2):
            x = x + self.attns[i](self.norms[2 * i](x))
            x = x + self.downs[i](F.gelu(self.ups[i](self.norms[2 * i + 1](x))))
        return x


def _net(heads: int, kv_heads: int) -> Net:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Net(heads, kv_heads)


def _shard(model: nn.Module, ws: int) -> tpcompile.ShardedModel:
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpcompile.TPCompileWarning)  # no part left whole
        return tpcompile.shard(model, ws, example_inputs=(torch.randn(2, 6, WIDTH),))


@pytest.mark.parametrize("heads, kv_heads, ws, layout, per_rank", [
    (4, 2, 4, ("S(1)", "S(1/2)"), 1),  # one query head a rank, each kv head held by the 2 ranks reading it
    (4, 2, 3, ("S(1~6)", "S(1~3)"), 2),  # whole groups: 2 query heads and their kv head a rank, the last one zeros
    # each kv head a piece held by ranks 0-2 and 3-4, its 4 query heads cut 2 | 2 | zeros and 2 | 2 (whole groups: 4)
    (8, 2, 5, ("S(1|4:2.2.0~6+4:2.2~4)", "S(1/2)"), 2),
    (6, 2, 8, ("S(1|3:1.1.1.0~4+3:1.1.1.0~4)", "S(1/2)"), 1),  # 3 query heads over the 4 ranks of each kv head
    (6, 2, 4, ("S(1|3:2.1~4+3:2.1~4)", "S(1/2)"), 2),  # 2 | 1 and a zero head (whole groups: 3)
    (12, 4, 6, ("S(1~18)", "S(1~6)"), 3),  # 4 kv heads leave a piece without ranks at 6: whole groups
    (12, 4, 2, ("S(1)", "S(1)"), 6),  # two kv heads and their six query heads a rank
    (4, 1, 5, ("S(1~5)", "S(1/1)"), 1),  # multi-query: the kv head whole on every rank, the query heads padded
])
def test_every_rank_reads_its_own_kv_heads(heads: int, kv_heads: int, ws: int, layout: tuple, per_rank: int) -> None:
    model = _net(heads, kv_heads)
    sm = _shard(model, ws)
    assert {m: sm.plan.modules[f"attns.0.{m}"] for m in "qkvo"} == \
        {"q": "column", "k": "column", "v": "column", "o": "row"}
    attn = next(n for n in sm.captured.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default)
    assert tuple(str(sm.decisions.placement(a)) for a in attn.args[:2]) == layout
    x = torch.randn(3, 5, WIDTH)  # another batch and length than the capture's
    with torch.no_grad():
        ref = model(x)
        for out in tpcompile.simulate(sm, x):
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    report = tpcompile.check_gradients(model.train(), sm, x)
    assert report.ok, str(report)
    # each rank's attention is the same call on its heads, its query heads reading its kv heads
    q, k = (sm.plan.parameters[f"attns.0.{m}.weight"].local_shape[0] // HEAD for m in "qk")
    assert q == per_rank and q % k == 0, (q, k)
    for r in range(ws):
        local = [n for n in sm.rank(r).graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
        assert len(local) == 2 and all(n.kwargs.get("enable_gqa") for n in local)


@pytest.mark.parametrize("ws", [4, 5])
def test_kv_projections_kept_whole_are_cut_locally(ws: int) -> None:
    """k and v computed whole on every rank (their projections kept whole, as a projection of fewer features than
    ranks is): each rank cuts the kv heads of its query heads out of them, not the whole heads."""
    model = _net(4, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, ws, example_inputs=(torch.randn(2, 6, WIDTH),),
                             plan={f"attns.{i}.{p}": "replicate" for i in range(2) for p in "kv"})
    assert sm.plan.modules["attns.0.k"] == "replicated" and sm.plan.modules["attns.0.q"] == "column"
    x = torch.randn(3, 5, WIDTH)
    with torch.no_grad():
        for out in tpcompile.simulate(sm, x):
            torch.testing.assert_close(out, model(x), atol=1e-5, rtol=0)
    report = tpcompile.check_gradients(model.train(), sm, x)
    assert report.ok, str(report)


def test_query_heads_that_are_not_whole_groups_are_refused() -> None:
    """The kv split of a query split: None where a rank's query heads would read kv heads that no layout binds to it
    (a query head a rank over 3-head groups at 2 ranks a kv head: no; padded heads one a rank over 2 groups of 4 at 5
    ranks: ranks 0-1 and 2-3 would read kv heads 0 and 1, pieces bind ranks 0-2 and 3-4)."""
    assert kv_split(Shard(1), 4, 2, 4) is not None and kv_split(Shard(1), 6, 3, 3) == Shard(1)
    assert kv_split(Shard(1), 6, 2, 6) is not None
    assert kv_split(Shard(1, cuts=((0, 2, 4, 6, 8, 10),)), 8, 2, 5) is None
    assert kv_split(Shard(1), 6, 2, 3) is None  # 2 query heads a rank over groups of 3


def test_each_rank_query_heads_checked_against_its_kv_heads() -> None:
    """`reads_own_kv` reads both layouts rank by rank: groups cut among the ranks of their kv head's piece pass, the
    same query cut over kv heads padded one a rank (ranks 1 and 2 would read kv heads 1 and 2 for group 0) fails."""
    groups = cut_shard(1, (4, 4), ((0, 2, 4, 6, 6, 6), (0, 0, 0, 0, 2, 4)), 5)
    assert str(groups) == "S(1|4:2.2.0~6+4:2.2~4)"
    assert kv_split(groups, 8, 2, 5) == piece_shard(1, 2, 2)
    assert reads_own_kv(groups, piece_shard(1, 2, 2), 8, 2, 5)
    assert not reads_own_kv(groups, Shard(1, cuts=pad_cuts(5, 5)), 8, 2, 5)
    assert reads_own_kv(Shard(1), Shard(1), 6, 2, 2)
    assert not reads_own_kv(Shard(1), piece_shard(1, 2, 1), 4, 2, 2)  # both kv heads on a rank: q head 1 would read 1
    assert reads_own_kv(Shard(1, cuts=pad_cuts(6, 3)), Shard(1, cuts=pad_cuts(3, 3)), 4, 2, 3)


def _gloo_rank(rank: int, heads: int, ws: int) -> dict:
    torch.set_num_threads(1)
    model = _net(heads, 2).train()
    gm = _shard(model, ws).rank(rank)
    x = torch.randn(2, 7, WIDTH, generator=torch.Generator().manual_seed(3))
    out = gm(x)
    out.pow(2).mean().backward()
    return {"out": out.detach(), "grads": {n: p.grad.clone() for n, p in gm.named_parameters()}}


@pytest.mark.gloo
@pytest.mark.parametrize("heads, ws, q_heads", [
    (4, 4, [[0], [1], [2], [3]]),  # one query head a rank, each kv head held by 2 ranks
    (8, 5, [[0, 1], [2, 3], [], [4, 5], [6, 7]]),  # kv heads held by ranks 0-2 and 3-4, rank 2's query heads zeros
])
def test_on_gloo_processes_equals_one_process(heads: int, ws: int, q_heads: list) -> None:
    """gloo processes, query heads over 2 kv heads: outputs and gradients of one process; a kv projection's gradient
    (in pieces: each kv head held by the ranks whose query heads read it) summed over the ranks sharing it, a query
    projection's zero heads without gradient."""
    model = _net(heads, 2).train()
    x = torch.randn(2, 7, WIDTH, generator=torch.Generator().manual_seed(3))
    ref = model(x)
    ref.pow(2).mean().backward()
    grads = dict(model.named_parameters())
    share = -(-ws // 2)
    for r, res in enumerate(launch(ws, _gloo_rank, heads, ws, timeout=300)):
        torch.testing.assert_close(res["out"], ref.detach(), atol=1e-5, rtol=0)
        mine = res["grads"]
        torch.testing.assert_close(mine["norms.0.weight"], grads["norms.0.weight"].grad, atol=1e-5, rtol=0)
        q = mine["attns.0.q.weight"]
        whole = grads["attns.0.q.weight"].grad
        real = torch.cat([whole[h * HEAD:(h + 1) * HEAD] for h in q_heads[r]] + [whole[:0]])
        torch.testing.assert_close(q[:len(real)], real, atol=1e-5, rtol=0)
        assert not q[len(real):].any()  # zero heads
        kv = slice(r // share * HEAD, (r // share + 1) * HEAD)
        torch.testing.assert_close(mine["attns.1.k.weight"], grads["attns.1.k.weight"].grad[kv], atol=1e-5, rtol=0)
