"""Reductions and norms over a split dim: exact from each rank's partial statistics and one small collective,
or, when that costs more than the weights a split saves, the projections before them replicated (said in the plan).
"""
from __future__ import annotations

import copy
import warnings
from dataclasses import replace
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpcompile
from tpcompile.api import shard_captured
from tpcompile.capture import capture
from tpcompile.passes.rank_module import local_tensor

Op = Callable[[nn.Module, torch.Tensor], torch.Tensor]


class WrittenRMSNorm(nn.Module):
    """RMSNorm spelled out: x * rsqrt(mean(x^2) + eps) * w."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Between(nn.Module):
    """A column split (16 -> 32), `fn` over its split features, a row split (32 -> 16)."""

    def __init__(self, fn: Op, norm: nn.Module | None = None) -> None:
        super().__init__()
        self.up, self.down, self.fn, self.norm = nn.Linear(16, 32), nn.Linear(32, 16), fn, norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.fn(self, self.up(x)))


def _norm(kind: str) -> nn.Module:
    torch.manual_seed(1)
    norm = {"layer": nn.LayerNorm(32), "rms": nn.RMSNorm(32), "written": WrittenRMSNorm(32)}[kind]
    with torch.no_grad():
        for p in norm.parameters():
            p.add_(0.1 * torch.randn_like(p))  # not the identity, so a wrong slice would show
    return norm


# (name, model, the op over the split dim, the collective its statistics use)
CASES = [
    ("layer_norm", lambda: Between(lambda m, h: m.norm(h), _norm("layer")), "aten.layer_norm.default", "all_gather"),
    ("rms_norm", lambda: Between(lambda m, h: m.norm(h), _norm("rms")), "aten.rms_norm.default", "all_gather"),
    ("rms_written", lambda: Between(lambda m, h: m.norm(h), _norm("written")), "aten.mean.dim", "all_reduce"),
    ("softmax", lambda: Between(lambda m, h: torch.softmax(h, -1)), "aten.softmax.int", "all_gather"),
    ("log_softmax", lambda: Between(lambda m, h: torch.log_softmax(h, -1)), "aten.log_softmax.int", "all_gather"),
    ("sum", lambda: Between(lambda m, h: h * h.sum(-1, keepdim=True)), "aten.sum.dim_IntList", "all_reduce"),
    ("mean", lambda: Between(lambda m, h: h - h.mean(-1, keepdim=True)), "aten.mean.dim", "all_reduce"),
    ("var", lambda: Between(lambda m, h: h / h.var(-1, keepdim=True)), "aten.var.dim", "all_gather_replicated"),
    ("std", lambda: Between(lambda m, h: h / h.std(-1, keepdim=True, correction=0)), "aten.std.correction",
     "all_gather_replicated"),
    ("vector_norm", lambda: Between(lambda m, h: F.normalize(h, dim=-1)), "aten.linalg_vector_norm.default",
     "all_gather_replicated"),
    ("amax", lambda: Between(lambda m, h: h - h.amax(-1, keepdim=True)), "aten.amax.default", "all_gather_replicated"),
    ("logsumexp", lambda: Between(lambda m, h: h - torch.logsumexp(h, -1, keepdim=True)), "aten.logsumexp.default",
     "all_gather_replicated"),
]


def _shard_quietly(cap: object, ws: int) -> tpcompile.ShardedModel:
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpcompile.TPCompileWarning)
        warnings.simplefilter("ignore", FutureWarning)  # deepcopy of torch's pytree spec
        return shard_captured(replace(cap, gm=copy.deepcopy(cap.gm)), ws)


def _grads(module: nn.Module, x: torch.Tensor) -> tuple[dict, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    module(x).pow(2).sum().backward()
    return {n: p.grad.clone() for n, p in module.named_parameters()}, x.grad


@pytest.mark.parametrize("name, build, op, collective", CASES, ids=[c[0] for c in CASES])
def test_reduction_over_split_dim_from_partial_statistics(name: str, build: Callable, op: str,
                                                          collective: str) -> None:
    """Both projections stay split; one statistics collective and the row split's all-reduce; the plan says so;
    every rank's output and gradients equal the original's at world sizes 2 and 4."""
    model = build().eval()
    cap = capture(model, (torch.randn(2, 5, 16),))
    x = torch.randn(3, 7, 16)
    ref_out = model(x).detach()
    ref_grads, ref_xgrad = _grads(model, x)
    for ws in (2, 4):
        sm = _shard_quietly(cap, ws)
        assert sm.plan.modules == {"up": "column", "down": "row"}
        assert [k for k in sm.plan.statistics if k.startswith(op)], sm.plan.statistics
        assert [c for c, _ in sm.collectives()] == [collective, "all_reduce"]
        ranks = [sm.rank(r) for r in range(ws)]
        outs = tpcompile.simulate_ranks(ws, lambda r: (ranks[r](x).detach(), *_grads(ranks[r], x)))
        for r, (out, grads, xgrad) in enumerate(outs):
            torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(xgrad, ref_xgrad, atol=2e-5, rtol=1e-4)
            for n, g in grads.items():
                want = local_tensor(ref_grads[n], sm.plan.parameters[n].slice(), r, ws)
                torch.testing.assert_close(g, want, atol=2e-5, rtol=1e-4, msg=f"{name}: grad of {n}")


class Tiny(nn.Module):
    """A narrow column split (4 -> 8, 128 bytes of weight) normalised, then a row split."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(4, 8, bias=False), nn.LayerNorm(8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.norm(self.up(x)))


@pytest.mark.parametrize("rows, chosen", [(2, "statistics"), (64, "replicated")])
def test_bytes_decide_between_statistics_and_replication(rows: int, chosen: str) -> None:
    """2 rows: 16 B of statistics beat the 64 B a split saves; 64 rows: 512 B do not, and up is replicated."""
    model = Tiny().eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, 2, example_inputs=(torch.randn(rows, 4),))
    said = [str(w.message) for w in caught if issubclass(w.category, tpcompile.TPCompileWarning)]
    if chosen == "statistics":
        assert not said and sm.plan.modules["up"] == "column"
        assert "16 B per call" in sm.plan.statistics["aten.layer_norm.default (layer_norm) at norm"]
    else:
        assert sm.plan.modules["up"] == "replicated" and not sm.plan.statistics
        assert "would move 512 B per call at the captured shape, more than the 64 B" in sm.plan.replicated["up"]
        assert len(said) == 1 and "replicating up" in said[0]
    x = torch.randn(5, 4)
    with torch.no_grad():
        for out in tpcompile.simulate(sm, x):
            torch.testing.assert_close(out, model(x), atol=2e-5, rtol=1e-5)


class QKNormAttention(nn.Module):
    """OLMo-2 style attention: RMSNorm over the whole q and k projections (all heads at once), then heads."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.q_norm, self.k_norm = nn.RMSNorm(d), nn.RMSNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.q_norm(self.q(x)), self.k_norm(self.k(x)), self.v(x)
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(B, T, D))


class LowRankQ(nn.Module):
    """DeepSeek-style low-rank query: a narrow q_a, a norm, q_b widening it again; k/v and o as usual."""

    def __init__(self, d: int = 64, rank: int = 8, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.q_a, self.q_norm, self.q_b = nn.Linear(d, rank, bias=False), nn.RMSNorm(rank), nn.Linear(rank, d)
        self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.q_b(self.q_norm(self.q_a(x))), self.k(x), self.v(x)
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        return self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, D))


def _held(sm: tpcompile.ShardedModel, model: nn.Module) -> float:
    """The fraction of the model's parameter elements rank 0 holds."""
    return sum(p.numel() for p in sm.rank(0).parameters()) / sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("ws", [2, 4])
def test_qk_norm_over_split_projections_keeps_heads_split(ws: int) -> None:
    """q/k RMSNorm over the whole projections: q, k, v column, o row; two statistics gathers and one all-reduce."""
    model = QKNormAttention().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, ws, example_inputs=(torch.randn(2, 8, 32),))
    assert sm.plan.modules == {"q": "column", "k": "column", "v": "column", "o": "row"}
    assert [c for c, _ in sm.collectives()] == ["all_gather", "all_gather", "all_reduce"]
    assert len(sm.plan.statistics) == 2
    assert _held(sm, model) <= 1.25 / ws
    x = torch.randn(3, 12, 32)
    with torch.no_grad():
        for out in tpcompile.simulate(sm, x):
            torch.testing.assert_close(out, model(x), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("ws", [2, 4])
def test_low_rank_projection_with_a_norm_stays_split(ws: int) -> None:
    """q_a whole (its note in the plan), the norm on the whole narrow value, q_b, k, v column and o row."""
    model = LowRankQ().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, ws, example_inputs=(torch.randn(2, 8, 64),))
    assert sm.plan.modules == {"q_a": "replicated", "q_b": "column", "k": "column", "v": "column", "o": "row"}
    assert "low-rank" in sm.plan.replicated["q_a"] and not sm.plan.statistics
    assert _held(sm, model) <= 1.25 / ws + 0.05  # q_a (512 of 12.9k parameters) is whole on every rank
    x = torch.randn(3, 5, 64)
    with torch.no_grad():
        for out in tpcompile.simulate(sm, x):
            torch.testing.assert_close(out, model(x), atol=2e-5, rtol=1e-5)


class HeadGroupNorm(nn.Module):
    """RWKV / RetNet style: the heads' outputs normalised per head by GroupNorm(heads) over (B*T, heads*dim)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.norm = nn.Linear(16, 32), nn.Linear(32, 16), nn.GroupNorm(4, 32)
        with torch.no_grad():
            self.norm.weight.add_(0.1 * torch.randn(32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        return self.down(self.norm(self.up(x).view(B * T, 32)).view(B, T, 32))


@pytest.mark.parametrize("ws", [2, 4])
def test_group_norm_per_head_keeps_whole_groups_per_rank(ws: int) -> None:
    """GroupNorm with a group per head: each rank normalises its own heads' groups, no collective of its own."""
    model = HeadGroupNorm().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, ws, example_inputs=(torch.randn(2, 5, 16),))
    assert sm.plan.modules == {"up": "column", "down": "row"}
    assert [c for c, _ in sm.collectives()] == ["all_reduce"]
    x = torch.randn(3, 7, 16)
    with torch.no_grad():
        for out in tpcompile.simulate(sm, x):
            torch.testing.assert_close(out, model(x), atol=2e-5, rtol=1e-5)


class PostNormMLP(nn.Module):
    """Gemma-style post-norm: a column -> row MLP whose output is cast to float32 and normed
    (x * rsqrt(mean(x^2))), then added to the residual stream; `blocks` of them."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.ups = nn.ModuleList(nn.Linear(16, 32, bias=False) for _ in range(blocks))
        self.downs = nn.ModuleList(nn.Linear(32, 16, bias=False) for _ in range(blocks))
        self.norms = nn.ModuleList(WrittenRMSNorm(16) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for up, down, norm in zip(self.ups, self.downs, self.norms):
            x = x + norm(down(F.gelu(up(x))).float())
        return x


@pytest.mark.parametrize("ws", [2, 4])
def test_a_row_split_read_whole_and_linearly_is_summed_once(ws: int) -> None:
    """The row split's sum is needed whole by the norm's statistics and read linearly by its scaling:
    the scaling reads the same sum (one all-reduce per block, not a second after the scaling); exact."""
    torch.manual_seed(0)
    model = PostNormMLP(3).eval()
    sm = tpcompile.shard(model, ws, example_inputs=(torch.randn(2, 5, 16),))
    assert [op for op, _ in sm.collectives()] == ["all_reduce"] * 3
    x = torch.randn(3, 7, 16)
    with torch.no_grad():
        ref = model(x)
        for r, out in enumerate(tpcompile.simulate(sm, x)):
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=0, msg=lambda m: f"rank {r}: {m}")
