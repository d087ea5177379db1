"""Head counts and widths the world size does not divide: heads zero-padded by whole heads, kv heads replicated
when they cannot line up with the query heads, exact forward and gradients, no warning."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpcompile
from tpcompile.placement import Shard, pad_cuts, rank_pieces
from tpcompile.report.plan_table import split_text
from tpcompile.sharding_rules.shape import reshape_placement


class Attention(nn.Module):
    """Grouped-query attention written the usual way: view to heads, repeat the kv heads, sdpa, merge, project."""

    def __init__(self, width: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q = nn.Linear(width, heads * head_dim)
        self.k = nn.Linear(width, kv_heads * head_dim)
        self.v = nn.Linear(width, kv_heads * head_dim)
        self.o = nn.Linear(heads * head_dim, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        rep = self.heads // self.kv_heads
        k = k[:, :, None].expand(b, self.kv_heads, rep, t, self.head_dim).reshape(b, self.heads, t, self.head_dim)
        v = v[:, :, None].expand(b, self.kv_heads, rep, t, self.head_dim).reshape(b, self.heads, t, self.head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, kv_heads: int, head_dim: int, ffn: int) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = Attention(width, heads, kv_heads, head_dim)
        self.up, self.down = nn.Linear(width, ffn), nn.Linear(ffn, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.n1(x))
        return x + self.down(F.gelu(self.up(self.n2(x))))


class Net(nn.Module):
    def __init__(self, heads: int, kv_heads: int, head_dim: int = 8, ffn: int = 50, width: int = 40) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(width, heads, kv_heads, head_dim, ffn) for _ in range(2)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def _shard(model: nn.Module, ws: int) -> tuple[tpcompile.ShardedModel, list]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sm = tpcompile.shard(model, ws, example_inputs=(torch.randn(2, 8, 40),))
    return sm, [w for w in caught if issubclass(w.category, tpcompile.TPCompileWarning)]


def _exact(model: nn.Module, sm: tpcompile.ShardedModel, x: torch.Tensor, grad_x: object = None) -> None:
    """Every rank's output equals the model's on x; with grad_x, every gradient agrees on it too."""
    with torch.no_grad():
        ref = model(x)
        for out in tpcompile.simulate(sm, x):
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    if grad_x is not None:
        report = tpcompile.check_gradients(model.train(), sm, grad_x)
        assert report.ok, str(report)


def _net(heads: int, kv_heads: int, **kw: int) -> Net:
    torch.manual_seed(0)
    return Net(heads, kv_heads, **kw).eval()


@pytest.mark.parametrize("ws, heads, kv, padded_q, padded_kv", [
    (4, 6, 6, 64, 64),  # 6 heads at 4 ranks: padded to 8 heads, 2 a rank, the last rank one real head
    (4, 6, 3, 64, 32),  # q 6 -> 8, kv 3 -> 4: each rank's two query heads use its one kv head
    (5, 8, 4, 80, 40),  # q 8 -> 10 at 5 ranks, kv 4 -> 5: 2 query heads and 1 kv head a rank
])
def test_heads_padded_by_whole_heads_are_split_and_exact(ws: int, heads: int, kv: int, padded_q: int,
                                                         padded_kv: int) -> None:
    model = _net(heads, kv)
    sm, warned = _shard(model, ws)
    assert not warned, [str(w.message) for w in warned]
    q, k = sm.plan.parameters["blocks.0.attn.q.weight"], sm.plan.parameters["blocks.0.attn.k.weight"]
    assert (q.role, q.padded, q.local_shape) == ("column", padded_q, (padded_q // ws, 40))
    assert (k.role, k.padded, k.local_shape) == ("column", padded_kv, (padded_kv // ws, 40))
    assert sm.plan.parameters["blocks.0.attn.o.weight"].local_shape == (40, padded_q // ws)
    ffn = sm.plan.parameters["blocks.0.up.weight"]
    assert ffn.padded == (None if 50 % ws == 0 else -(-50 // ws) * ws) and ffn.local_shape[0] == -(-50 // ws)
    # Megatron's minimum: one all-reduce after attention and one after the MLP of each block
    assert sorted(op for op, _ in sm.collectives()) == ["all_reduce"] * 4
    _exact(model, sm, torch.randn(3, 13, 40))  # another batch and length than the capture's


def test_padded_heads_gradients_agree() -> None:
    model = _net(6, 3).train()
    sm, warned = _shard(model, 4)
    assert not warned
    report = tpcompile.check_gradients(model, sm, torch.randn(2, 9, 40))
    assert report.ok, str(report)


def test_kv_heads_that_cannot_line_up_are_replicated_by_choice() -> None:
    """14 query heads on 2 kv heads at 7 ranks: query heads 2 a rank; whole groups of 7 would hold more, each group
    cut among the ranks holding its kv head no less (the 3 holding kv head 1 need 3 a rank: 3 + 3 + 1 + 1 heads of
    q, o, k and v against 2 + 2 + 2 + 2), so each rank keeps both kv heads (kv-head replication), no warning."""
    model = _net(14, 2, head_dim=4, width=40)
    sm, warned = _shard(model, 7)
    assert not warned, [str(w.message) for w in warned]
    assert sm.plan.parameters["blocks.0.attn.q.weight"].local_shape == (8, 40)
    assert sm.plan.parameters["blocks.0.attn.k.weight"].role == "replicated"
    why = sm.plan.replicated["blocks.0.attn.k"]
    assert "kv-head replication" in why and "do not line up with the query heads" in why
    assert sorted(op for op, _ in sm.collectives()) == ["all_reduce"] * 4
    _exact(model, sm, torch.randn(2, 11, 40))


def test_a_padded_dim_reshapes_by_whole_heads_only() -> None:
    """(B, T, 48 padded to 64) -> (B, T, 6 heads padded to 8, 8) and back; a cut inside a head is refused."""
    p = Shard(2, cuts=pad_cuts(64, 4))
    heads, why = reshape_placement(p, (2, 8, 48), (2, 8, 6, 8), 4)
    assert heads == Shard(2, cuts=pad_cuts(8, 4)) and why == ""
    back, _ = reshape_placement(Shard(2, cuts=pad_cuts(8, 4)), (2, 8, 6, 8), (2, 8, 48), 4)
    assert back == Shard(2, cuts=pad_cuts(64, 4))
    cut, why = reshape_placement(Shard(2, cuts=pad_cuts(52, 4)), (2, 8, 50), (2, 8, 5, 10), 4)
    assert cut is None and "padded" in why


def test_plan_shows_each_ranks_real_share() -> None:
    model = _net(6, 6)
    sm, _ = _shard(model, 4)
    text = split_text(sm.plan.parameters["blocks.0.attn.q.weight"])
    assert text == "column@0 padded 64 (16|16|16|0) heads 2|2|2|0", text
    assert split_text(sm.plan.parameters["blocks.0.attn.o.weight"]).endswith(" heads 2|2|2|0")


class FusedAttention(nn.Module):
    """One q|k|v projection, cut by split (GPT-2) or by slices of different sizes (Phi-3's grouped q|k|v)."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, width: int = 40, slices: bool = False) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.slices = heads, kv_heads, head_dim, slices
        self.qkv = nn.Linear(width, (heads + 2 * kv_heads) * head_dim)
        self.o = nn.Linear(heads * head_dim, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv, nq, nk = self.qkv(x), self.heads * self.head_dim, self.kv_heads * self.head_dim
        if self.slices:
            q, k, v = qkv[..., :nq], qkv[..., nq:nq + nk], qkv[..., nq + nk:]
        else:
            q, k, v = qkv.split([nq, nk, nk], dim=-1)
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        rep = self.heads // self.kv_heads
        k, v = (z.repeat_interleave(rep, dim=1) for z in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(b, t, -1))


@pytest.mark.parametrize("ws, heads, kv, slices, pads, local", [
    (3, 4, 4, False, (48, 48, 48), 48),  # GPT-2's fused q|k|v: 4 heads of 8 padded to 6 at 3 ranks, in each segment
    (5, 8, 4, True, (80, 40, 40), 32),   # q 8 -> 10 heads, k and v 4 -> 5: a rank's 2 query heads use its kv head
    (3, 4, 1, False, (48, 8, 8), 32),    # multi-query (GPTBigCode, Falcon): q 4 -> 6 heads, the one kv head whole
])
def test_fused_projection_pads_each_segment_by_whole_heads(ws: int, heads: int, kv: int, slices: bool,
                                                           pads: tuple, local: int) -> None:
    torch.manual_seed(0)
    model = FusedAttention(heads, kv, 8, slices=slices).eval()
    sm, warned = _shard(model, ws)
    assert not warned, [str(w.message) for w in warned]
    p = sm.plan.parameters["qkv.weight"]
    assert (p.role, p.padded, p.local_shape) == ("column", pads, (local, 40))
    held = [sum(n for _, _, n in rank_pieces(p.slice(), sum(p.segments), r, ws)) for r in range(ws)]
    assert split_text(p).endswith(f"({'|'.join(map(str, held))}) heads {'|'.join(str(h // 8) for h in held)}")
    assert f"padded {'+'.join(map(str, pads))}" in split_text(p)
    assert sorted(op for op, _ in sm.collectives()) == ["all_reduce"]
    _exact(model, sm, torch.randn(3, 11, 40), torch.randn(2, 9, 40))


@pytest.mark.parametrize("ws, q_rows, kv_rows", [(3, 18 * 4 // 3, 8), (6, 18 * 4 // 6, 4)])
def test_query_heads_padded_by_whole_kv_groups_when_that_holds_less(ws: int, q_rows: int, kv_rows: int) -> None:
    """12 query heads on 4 kv heads at 3 and 6 ranks: whole groups (a kv head and its 3 query heads, the last
    ranks' zeros) hold fewer bytes than the query heads split beside all 4 kv heads (as many at 3 ranks, where the
    kv heads split wins the tie), so the groups are padded, not the kv heads replicated. (At 8 ranks, a multiple of
    the kv heads, each group is split among the 2 ranks sharing its kv head instead: tests/test_group_cuts.py.)"""
    model = _net(12, 4, head_dim=4, width=40)
    sm, warned = _shard(model, ws)
    assert not warned, [str(w.message) for w in warned]
    q, k = sm.plan.parameters["blocks.0.attn.q.weight"], sm.plan.parameters["blocks.0.attn.k.weight"]
    assert (q.role, q.local_shape) == ("column", (q_rows, 40)) and (k.role, k.local_shape) == ("column", (kv_rows, 40))
    assert not sm.plan.replicated
    assert sorted(op for op, _ in sm.collectives()) == ["all_reduce"] * 4
    _exact(model, sm, torch.randn(2, 11, 40), torch.randn(2, 7, 40))


def test_expert_features_the_world_size_does_not_divide_are_padded() -> None:
    """Qwen2-MoE's experts (32 features, gate|up fused in one 3-D weight) at 3 ranks: each segment padded to 33,
    11 a rank, no warning, every rank under 1.2 / 3 of the parameters, the logits exact."""
    from hf_models import ALL_ARCHS, build, held_share, inputs

    arch = next(a for a in ALL_ARCHS if a.name == "qwen2_moe")
    model = build(arch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, 3, example_kwargs=inputs(arch, 2, 8))
    cut = {n: p for n, p in sm.plan.parameters.items() if n.startswith("model.layers.0.mlp.experts.")}
    assert cut and all(p.padded in (33, (33, 33)) for p in cut.values()), cut
    assert held_share(model, sm) * 3 < 1.2
    kw = inputs(arch, 3, 13)
    with torch.no_grad():
        ref = model(**kw).logits
        for out in tpcompile.simulate(sm, **kw):
            torch.testing.assert_close(out.logits, ref, atol=1e-4, rtol=0)


COUNTS = dict(num_attention_heads=12, num_key_value_heads=4, hidden_size=96, intermediate_size=200, vocab_size=250)


@pytest.mark.parametrize("name, ws", [("phi3", 6), ("persimmon", 5), ("llama", 8)])
def test_hugging_face_counts_the_world_size_does_not_divide(name: str, ws: int) -> None:
    """12 heads, 4 kv heads, FFN 200, vocabulary 250: Phi-3's fused q|k|v by whole kv groups, Persimmon's
    (heads, 3, head_dim) q|k|v by whole heads, Llama at 8 ranks; no warning, exact on another batch and length."""
    from hf_models import ALL_ARCHS, build, held_share, inputs

    arch = next(a for a in ALL_ARCHS if a.name == name)
    model = build(arch, **COUNTS)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, ws, example_kwargs=inputs(arch, 2, 8))
    assert held_share(model, sm) * ws < 1.3
    kw = inputs(arch, 3, 13)
    with torch.no_grad():
        ref = model(**kw).logits
        for out in tpcompile.simulate(sm, **kw):
            torch.testing.assert_close(out.logits, ref, atol=1e-4, rtol=0)


class NormedAttention(nn.Module):
    """q and k normalised over the whole projection before the heads (OLMoE's q_norm / k_norm), by a hand-written
    RMSNorm (mean of squares) or F.rms_norm; `shift` adds a constant first, which fills the padding."""

    def __init__(self, heads: int, head_dim: int = 8, width: int = 40, fused: bool = False, shift: float = 0.0):
        super().__init__()
        self.heads, self.head_dim, self.fused, self.shift = heads, head_dim, fused, shift
        self.q, self.k, self.v = (nn.Linear(width, heads * head_dim) for _ in range(3))
        self.qn, self.kn = nn.Parameter(torch.rand(heads * head_dim) + 0.5), nn.Parameter(torch.rand(heads * head_dim))
        self.o = nn.Linear(heads * head_dim, width)

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x = x + self.shift if self.shift else x
        if self.fused:
            return F.rms_norm(x, (x.shape[-1],), w, 1e-6)
        return w * (x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self._norm(self.q(x), self.qn).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self._norm(self.k(x), self.kn).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(b, t, -1))


@pytest.mark.parametrize("fused", [False, True])
def test_a_norm_over_a_padded_projection_sums_what_the_ranks_hold(fused: bool) -> None:
    """6 heads at 4 ranks, q and k normalised over all their features: the padding holds zeros, so each rank's
    sum of squares over its heads adds up to the real one; split, no warning, exact with gradients."""
    torch.manual_seed(0)
    model = NormedAttention(6, fused=fused).eval()
    sm, warned = _shard(model, 4)
    assert not warned, [str(w.message) for w in warned]
    assert sm.plan.parameters["q.weight"].local_shape == (16, 40)
    assert sm.plan.parameters["qn"].local_shape == (16,)
    _exact(model, sm, torch.randn(3, 13, 40), grad_x=torch.randn(2, 9, 40))


def test_a_norm_over_padding_that_is_not_zero_is_not_split() -> None:
    """A constant added before the norm puts it into the padding too: the projections stay whole, with a warning
    naming the reduction, and the result stays exact."""
    torch.manual_seed(0)
    model = NormedAttention(6, shift=0.5).eval()
    sm, warned = _shard(model, 4)
    assert any("padded" in str(w.message) and "q" in str(w.message) for w in warned), [str(w.message) for w in warned]
    assert sm.plan.parameters["q.weight"].role == "replicated"
    _exact(model, sm, torch.randn(3, 13, 40))


class FoldedAttention(nn.Module):
    """Attention on (batch * heads, T, d) by bmm (XGLM's and BART's way): scores clamped from below with
    torch.max, a mask added on the (batch, heads, T, T) view, and a rope-like part of every head written into a
    fresh tensor from a value all heads share (DeepSeek's k_pe)."""

    def __init__(self, heads: int, head_dim: int = 8, width: int = 40) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.q, self.k, self.v = (nn.Linear(width, heads * head_dim) for _ in range(3))
        self.shared = nn.Linear(width, 2)
        self.o = nn.Linear(heads * head_dim, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h, d = self.heads, self.head_dim
        q = self.q(x).view(b, t, h, d).transpose(1, 2)
        k_own = self.k(x).view(b, t, h, d).transpose(1, 2)
        k = k_own.new_empty(b, h, t, d + 2)
        k[..., :d] = k_own
        k[..., d:] = self.shared(x)[:, None].expand(b, h, t, 2)
        q = torch.cat([q, q[..., :2]], dim=-1)
        v = self.v(x).view(b, t, h, d).transpose(1, 2).reshape(b * h, t, d)
        scores = torch.bmm(q.reshape(b * h, t, d + 2), k.reshape(b * h, t, d + 2).transpose(1, 2))
        causal = torch.full((t, t), float("-inf")).triu(1)
        scores = (scores.view(b, h, t, t) + causal).view(b * h, t, t)
        scores = torch.max(scores, torch.tensor(torch.finfo(scores.dtype).min))
        y = torch.bmm(scores.softmax(-1), v).view(b, h, t, d).transpose(1, 2).reshape(b, t, h * d)
        return x + self.o(y)


@pytest.mark.parametrize("ws", [4, 5])
def test_heads_folded_with_the_batch_stay_padded(ws: int) -> None:
    """6 heads at 4 and 5 ranks through (batch * heads) bmm attention: the padded heads fold with the batch and
    back, the fresh key tensor is padded like the heads it holds; no warning, one all-reduce, exact."""
    torch.manual_seed(0)
    model = FoldedAttention(6).eval()
    sm, warned = _shard(model, ws)
    assert not warned, [str(w.message) for w in warned]
    per = -(-6 // ws)
    assert sm.plan.parameters["q.weight"].local_shape == (per * 8, 40)
    assert sm.plan.parameters["shared.weight"].role == "replicated"
    assert [op for op, _ in sm.collectives()] == ["all_reduce"]
    _exact(model, sm, torch.randn(3, 11, 40), grad_x=torch.randn(2, 7, 40))


def test_fewer_heads_than_ranks_are_padded_one_a_rank() -> None:
    """2 heads (as many kv heads) at 4 ranks: padded to 4, one a rank, rather than pieces shared by ranks (which
    would count each query head twice in the output projection's sum); no warning, exact."""
    model = _net(2, 2)
    sm, warned = _shard(model, 4)
    assert not warned, [str(w.message) for w in warned]
    for name in ("q", "k", "v"):
        p = sm.plan.parameters[f"blocks.0.attn.{name}.weight"]
        assert (p.role, p.padded, p.pieces, p.local_shape) == ("column", 32, None, (8, 40)), (name, p)
    assert sorted(op for op, _ in sm.collectives()) == ["all_reduce"] * 4
    _exact(model, sm, torch.randn(3, 13, 40))
