"""Sequence parallelism at any length: tokens split in shares that differ by one (layouts/token_shares.py).

The first T % ws ranks hold one token more; a rank may hold none (T < ws). The collectives pad each share to
the largest and drop the padding, the gathers are given T, and reductions over tokens combine the shares
exactly (a mean by the count, a max over ranks without a token).
"""
from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn
from torch.export import Dim

import hf_models
from test_sequence_parallel import _train
from test_sequence_parallel_flat import _grads

import tpcompile
from tpcompile.layouts import token_shares
from tpcompile.models import build
from tpcompile.passes.rank_module import local_tensor
from tpcompile.runtime import launch
from tpcompile.runtime.startup_check import schedule

LENGTHS = (16, 10, 7, 2)  # at 3 ranks: 6|5|5, 4|3|3, 3|2|2, 1|1|0


@pytest.mark.parametrize("world_size", [1, 2, 3, 5, 8])
def test_shares_are_tensor_splits(world_size: int) -> None:
    """Every rank's share and start are torch.tensor_split's; the shares tile the length, within one token."""
    for total in range(0, 30):
        parts = torch.tensor_split(torch.arange(total), world_size)
        assert token_shares.shares(total, world_size) == [len(p) for p in parts]
        starts = [token_shares.start(total, r, world_size) for r in range(world_size)]
        assert starts == [sum(len(p) for p in parts[:r]) for r in range(world_size)]
        assert token_shares.slot(total, world_size) == max(len(p) for p in parts)


@pytest.mark.parametrize("name,world_size", [("gpt", 3), ("gpt-manual", 3), ("gpt-sep", 5), ("gpt", 8)])
def test_any_length_equals_original(name: str, world_size: int) -> None:
    """The bundled GPTs with sequence parallelism at 3, 5 and 8 ranks give the original's logits at lengths the
    world size does not divide, and shorter than it (ranks without a token)."""
    model = build(name)
    sm = tpcompile.shard(model, world_size, sequence_parallel=True)
    for t in LENGTHS:
        idx = torch.randint(0, 256, (2, t), generator=torch.Generator().manual_seed(t))
        with torch.no_grad():
            ref = model(idx)
            for out in tpcompile.simulate(sm, idx):
                torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_training_at_uneven_lengths_equals_original() -> None:
    """Four AdamW steps at 3 ranks on lengths 10 and 7: each rank's losses equal the original's, and the
    replicated parameters' gradients (summed over token shares of 4|3|3) are the original's."""
    model = build("gpt").train()
    ref_model = copy.deepcopy(model)
    sm = tpcompile.shard(model, 3, sequence_parallel=True)
    ranks = [sm.rank(r) for r in range(3)]
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 256, (2, 10), generator=gen), torch.randint(0, 256, (3, 7), generator=gen)]
    ref_losses, ref_grads = _train(ref_model, batches, 4)
    for losses, grads in tpcompile.simulate_ranks(3, lambda r: _train(ranks[r], batches, 4)):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        for name in ("transformer.ln_f.weight", "transformer.h.0.ln_1.bias", "transformer.h.1.mlp.c_proj.bias"):
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["gpt2", "opt", "deepseek_v3"])
def test_flattened_tokens_at_any_length(name: str) -> None:
    """Tokens flattened with the batch ((B*T, C): GPT-2's Conv1D, OPT's MLP) and a router's top-2 choices flattened
    with them (DeepSeek-V3: 2 entries a token) at 3 ranks, lengths 10, 7 and 2: the logits and every rank's
    gradients equal the original's."""
    arch = next(a for a in hf_models.ARCHS + hf_models.NEW_ARCHS if a.name == name)
    model = hf_models.build(arch)
    sm = tpcompile.shard(model, 3, example_kwargs=hf_models.inputs(arch, 2, 8), sequence_parallel=True)
    for b, t in ((3, 10), (2, 7), (1, 2)):
        kwargs = hf_models.inputs(arch, b, t)
        with torch.no_grad():
            ref = model(**kwargs).logits
            for out in tpcompile.simulate(sm, **kwargs):
                torch.testing.assert_close(out.logits, ref, atol=2e-5, rtol=1e-5)
    kwargs = hf_models.inputs(arch, 2, 7)
    want = _grads(copy.deepcopy(model), kwargs, "logits")
    ranks = [sm.rank(r) for r in range(3)]
    for r, got in enumerate(tpcompile.simulate_ranks(3, lambda r: _grads(ranks[r], kwargs, "logits"))):
        for n, g in got.items():
            torch.testing.assert_close(g, local_tensor(want[n], sm.plan.parameters[n].slice(), r, 3),
                                       atol=1e-6, rtol=1e-4, msg=n)


class _Pooled(nn.Module):
    """Token embeddings, an MLP block, and a reduction over the tokens before a classifier head."""

    def __init__(self, pool: str) -> None:
        super().__init__()
        self.pool = pool
        self.emb, self.ln, self.ln2 = nn.Embedding(64, 32), nn.LayerNorm(32), nn.LayerNorm(32)
        self.up, self.down, self.head = nn.Linear(32, 96), nn.Linear(96, 32), nn.Linear(32, 8)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        h = self.ln2(h + self.down(torch.relu(self.up(self.ln(h)))))
        pooled = {"mean": lambda: h.mean(1), "max": lambda: h.amax(1), "min": lambda: h.amin(1),
                  "sum": lambda: h.sum(1), "logsumexp": lambda: h.logsumexp(1)}[self.pool]()
        return self.head(pooled)


@pytest.mark.parametrize("pool", ["mean", "max", "min", "sum", "logsumexp"])
def test_reductions_over_token_shares(pool: str) -> None:
    """A pool over the tokens at 4 ranks, lengths 10 (3|3|2|2) and 2 (two ranks without a token): the output and
    the replicated parameters' gradients equal the original's (a mean divides the summed shares by the length; a
    max or min of a rank without a token never wins)."""
    torch.manual_seed(0)
    model = _Pooled(pool)
    example = torch.randint(0, 64, (2, 12))
    sm = tpcompile.shard(model, 4, example_inputs=(example,), dynamic_shapes=({0: Dim("b"), 1: Dim("t")},),
                         sequence_parallel=True)
    assert ("reduce_scatter", "emb") in sm.collectives()  # the tokens are split
    for t in (10, 2):
        idx = torch.randint(0, 64, (3, t), generator=torch.Generator().manual_seed(t))
        model.zero_grad()
        ref = model(idx)
        ref.square().sum().backward()

        def run(rank: int) -> tuple:
            gm = sm.rank(rank)
            gm.zero_grad()
            out = gm(idx)
            out.square().sum().backward()
            return out.detach(), {n: p.grad for n, p in gm.named_parameters()}

        for out, grads in tpcompile.simulate_ranks(4, run):
            torch.testing.assert_close(out, ref.detach(), atol=1e-5, rtol=1e-5)
            for name in ("ln2.weight", "ln.bias", "down.bias"):
                torch.testing.assert_close(grads[name], dict(model.named_parameters())[name].grad,
                                           atol=1e-5, rtol=1e-4)


class _Spread(nn.Module):
    """A fixed count of 10 tokens (a learned table), an MLP block, and the variance over the tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Parameter(torch.randn(10, 16))
        self.ln, self.up, self.down = nn.LayerNorm(16), nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x[:, None, :] + self.tokens
        h = self.ln(h + self.down(torch.relu(self.up(h))))
        return h.var(1)


def test_variance_over_uneven_shares_is_gathered() -> None:
    """A variance over 10 fixed tokens is merged from partial statistics at 2 ranks (5|5); at 4 (3|3|2|2) the
    tokens are gathered first instead. Both equal the original."""
    torch.manual_seed(0)
    model = _Spread()
    x = torch.randn(3, 16)
    for ws, merged in ((2, True), (4, False)):
        sm = tpcompile.shard(model, ws, example_inputs=(torch.randn(2, 16),), sequence_parallel=True)
        assert bool(sm.plan.statistics) == merged
        assert [op for op, _ in sm.collectives()] == ["reduce_scatter", "all_gather_replicated"]
        with torch.no_grad():
            for out in tpcompile.simulate(sm, x):
                torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


def test_schedules_agree_across_ranks_whose_shares_differ() -> None:
    """Each simulated rank's collective schedule, traced on symbolic sizes where the ranks' shares differ (rank 0
    holds ceil(T / 3) tokens, rank 2 floor), is the same on every rank: a gather is recorded by its even share."""
    sm = tpcompile.shard(build("gpt"), 3, sequence_parallel=True)
    fake = [n.meta["val"] for n in sm.captured.graph.nodes if n.op == "placeholder"]
    one_at_a_time = threading.Lock()  # the fake tensors' shape environment is shared; fake ops never communicate

    def traced(rank: int) -> list:
        with one_at_a_time:
            return schedule(sm.rank(rank), fake)
    schedules = tpcompile.simulate_ranks(3, traced)
    assert schedules[0] == schedules[1] == schedules[2]
    gathers = [e for e in schedules[0] if e.op == "all_gather"]
    assert gathers and all(e.shape[1] == "(d1//3)" for e in gathers), gathers


def _parallelized(rank: int) -> dict:
    """On one of 3 gloo processes: the bundled GPT (4 heads: 2|2|0) parallelized with and without sequence
    parallelism (the startup agreement compares the ranks' schedules), run on lengths 10 and 7; and its rank graph
    with the collectives lowered to torch.ops._c10d_functional (torch.compile's spelling), forward and backward."""
    torch.manual_seed(0)
    model = build("gpt")
    out = {}
    for sp in (False, True):
        gm = tpcompile.parallelize(model, example_inputs=model.example_inputs(), sequence_parallel=sp)
        for t in (10, 7):
            idx = torch.randint(0, 256, (2, t), generator=torch.Generator().manual_seed(t))
            with torch.no_grad():
                out[(sp, t)] = float((gm(idx) - model(idx)).abs().max())
    lowered = tpcompile.shard(model, 3, sequence_parallel=True, comm=tpcompile.CommOptions(lower_c10d=True))
    gm, idx = lowered.rank(rank), torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(1))
    got, want = gm(idx), model(idx)
    got.square().mean().backward()
    want.square().mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    out["lowered"] = max([float((got - want).abs().max())] + [
        float((p.grad - grads[n]).abs().max()) for n, p in gm.named_parameters() if "ln" in n])
    block, x = nn.Sequential(_ParallelBlock(), _ParallelBlock()), torch.randn(2, 8, 24)  # the same on every rank
    lowered = tpcompile.shard(block, 3, example_inputs=(x,), sequence_parallel=True,
                              comm=tpcompile.CommOptions(lower_c10d=True))
    gm = lowered.rank(rank)
    got, want = gm(x), block(x)  # an in-place add to reduce-scattered shares of 3|3|2 tokens
    got.square().mean().backward()
    want.square().mean().backward()
    grads = {n: p.grad for n, p in block.named_parameters()}
    out["lowered in place"] = max([float((got - want).abs().max())] + [
        float((p.grad - grads[n]).abs().max()) for n, p in gm.named_parameters() if "norm" in n])
    return out


@pytest.mark.gloo
def test_parallelize_on_three_processes_at_any_length() -> None:
    """tpcompile.parallelize on 3 gloo processes: the ranks agree on their schedules (a zero-padded head block
    traced symbolically) and give the original's logits, with tokens in shares of 4|3|3 and 3|2|2; the lowered
    collectives give the original's logits and norm gradients too, an in-place add to their results included."""
    for rank, diffs in enumerate(launch(3, _parallelized, timeout=240)):
        assert set(diffs) == {(sp, t) for sp in (False, True) for t in (10, 7)} | {"lowered", "lowered in place"}
        assert max(diffs.values()) < 1e-5, (rank, diffs)


@pytest.mark.gloo
def test_training_under_torchrun_at_an_uneven_length() -> None:
    """examples/train_hybrid.py at tp 3 with sequence parallelism under torchrun (3 gloo processes), 10 tokens a
    sequence (4|3|3): the single process's losses, step after step."""
    from hybrid_matrix import TOLERANCE, run_example, worst_relative

    args = ["--inputs", "4x10:long", "--steps", "3", "--json"]
    out = run_example(["--tp", "3", "--sequence-parallel", *args], nproc=3)
    ref = run_example(args)
    assert worst_relative(out["losses"], ref["losses"]) < TOLERANCE, (out["losses"], ref["losses"])


def test_the_lengths_table_renders_a_run() -> None:
    """bench/sp_lengths.py on one architecture at 3 ranks: every length equal, the row rendered with the shares."""
    from bench.sp_lengths import render, run_one

    arch = next(a for a in hf_models.ARCHS if a.name == "llama")
    row = {"arch": "llama", "ws": 3, **run_one(arch, 3)}
    assert max(row["diffs"]) < 1e-4 and row["split"] == row["sums"] > 0
    text = render([row, {"arch": "llama", "ws": 5, "error": "RuntimeError: x"}], 1.0)
    assert "3 ranks: 3|2|2, 1|1|0, 3|3|3" in text and "1 of 2 rows are equal" in text
    assert "- llama at 5: `RuntimeError: x`" in text


class _ParallelBlock(nn.Module):
    """Attention-free parallel block (Falcon's, GPT-J's): the feed-forward output takes the mixer's in place, both
    straight from their row projections (no bias), which sequence parallelism makes reduce-scatters."""

    def __init__(self, dim: int = 24) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mix_in, self.mix_out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim, bias=False)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        mixed = self.mix_out(torch.tanh(self.mix_in(h)))
        out = self.fc2(torch.relu(self.fc1(h)))
        out += mixed
        return x + out


@pytest.mark.parametrize("world_size,length", [(3, 8), (5, 8), (3, 9)])
def test_in_place_add_to_a_reduce_scattered_share_trains(world_size: int, length: int) -> None:
    """An in-place add to a reduce-scatter's result: every token share, the largest ones included (its padded
    slot whole), is a tensor of its own, not a view autograd refuses to modify in place; the gradients equal
    the original's."""
    model = nn.Sequential(_ParallelBlock(), _ParallelBlock()).train()
    sm = tpcompile.shard(model, world_size, example_inputs=(torch.randn(2, length, 24),), sequence_parallel=True)
    assert any("reduce_scatter" in str(n.target) for n in sm.rank(0).graph.nodes)
    report = tpcompile.check_gradients(model, sm, torch.randn(2, length, 24))
    assert report.ok, str(report)


class _LowRankGate(nn.Module):
    """Heads gated by a low-rank projection of the block's input (Kimi-Linear's and Doge's output gate): the gate's
    up-projection ends its own split region, so sequence parallelism leaves it split by tokens, while the heads it
    multiplies are split by heads."""

    def __init__(self, dim: int = 32, heads: int = 4, rank: int = 16) -> None:
        super().__init__()
        self.heads, self.norm = heads, nn.LayerNorm(dim)
        self.q, self.v, self.o = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim, bias=False)
        self.g_a, self.g_b = nn.Linear(dim, rank, bias=False), nn.Linear(rank, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.norm(x)
        q, v = (p(h).view(b, t, self.heads, -1) for p in (self.q, self.v))
        mixed = torch.softmax(q, -1) * v.cumsum(1)
        gate = torch.sigmoid(self.g_b(self.g_a(h))).view(b, t, self.heads, -1)
        return x + self.o((mixed * gate).reshape(b, t, d))


@pytest.mark.parametrize("world_size,length", [(2, 8), (3, 7)])
def test_a_token_split_read_split_by_heads_is_gathered_first(world_size: int, length: int) -> None:
    """The gate, split by tokens, read by an op split by heads: its tokens are gathered before this rank's heads
    are cut from it (before, it reached the product as it was, and the ranks failed on mismatched shapes); outputs
    and gradients equal the original's."""
    model = nn.Sequential(_LowRankGate(), _LowRankGate()).train()
    x = torch.randn(2, length, 32)
    sm = tpcompile.shard(model, world_size, example_inputs=(x,), sequence_parallel=True)
    report = tpcompile.check_gradients(model, sm, torch.randn(3, length + 2, 32))
    assert report.ok, str(report)

