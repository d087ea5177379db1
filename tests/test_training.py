"""Training through the sharded ranks matches training the original model, step for step.

For the bundled GPT and a small Hugging Face Llama, at 2 and 4 simulated ranks, the
unsharded model and every rank take the same AdamW steps on one fixed batch, with the
next-token cross-entropy computed outside the model from the (gathered) logits.

The step-by-step loss comparison runs in float64. In float32 the two runs drift apart by
up to ~1e-5 relative after a few steps for a reason unrelated to sharding: the gradient of
the attention key bias is mathematically zero (softmax ignores a per-query constant), so it
is pure rounding noise of ~1e-11, and Adam's normalisation turns the sign of that noise into
updates of ~lr/100 that differ between any two summation orders. float64 shrinks that noise
far below the 1e-5 tolerance; the float32 first step is checked separately.
"""
from __future__ import annotations

import copy
import functools
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpcompile
from tpcompile.models import build
from tpcompile.ops import collectives
from tpcompile.passes.rank_module import local_tensor

STEPS = 5
LR = 1e-2
TOL = 1e-5
CASES = [("gpt", 2), ("gpt", 4), ("llama", 2), ("llama", 4)]
IDS = [f"{name}-ws{ws}" for name, ws in CASES]


@dataclass
class Model:
    """A model in train mode, its fixed batch, how to call it and where its logits are."""

    module: nn.Module
    ids: torch.Tensor
    args: tuple
    kwargs: dict
    logits: Callable[[Any], torch.Tensor]
    n_layer: int


def _gpt(dtype: torch.dtype) -> Model:
    model = build("gpt")
    assert model.config.dropout == 0.0
    model = model.train().to(dtype)
    ids = torch.randint(0, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
    return Model(model, ids, (ids,), {}, lambda out: out, model.config.n_layer)


def _llama(dtype: torch.dtype) -> Model:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      max_position_embeddings=64)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).train().to(dtype)
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    return Model(model, ids, (), {"input_ids": ids, "use_cache": False}, lambda out: out["logits"],
                 config.num_hidden_layers)


def _next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of predicting token t+1 from positions <= t."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


@dataclass
class Run:
    """Losses per step, first-step gradients and first-backward collectives of both runs."""

    model: Model
    sharded: tpcompile.ShardedModel
    ref_losses: list[float]
    ref_grads: dict[str, torch.Tensor]
    losses: list[list[float]]  # [rank][step]
    grads: list[dict[str, torch.Tensor]]  # [rank] name -> gradient after the first backward
    events: list[collectives.CollectiveEvent]  # collectives of the first forward and backward


@functools.lru_cache(maxsize=None)
def _train(name: str, ws: int, dtype: torch.dtype, steps: int) -> Run:
    m = (_gpt if name == "gpt" else _llama)(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(m.module, ws, example_inputs=m.args, example_kwargs=m.kwargs)
    ranks = [sm.rank(r) for r in range(ws)]  # build every rank graph before the threads start

    ref = copy.deepcopy(m.module)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    ref_losses, ref_grads = [], {}
    for step in range(steps):
        opt.zero_grad()
        loss = _next_token_loss(m.logits(ref(*m.args, **m.kwargs)), m.ids)
        loss.backward()
        if step == 0:
            ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters(remove_duplicate=False)}
        opt.step()
        ref_losses.append(loss.item())

    opts = [torch.optim.AdamW(gm.parameters(), lr=LR) for gm in ranks]
    losses: list[list[float]] = [[] for _ in range(ws)]
    grads: list[dict[str, torch.Tensor]] = [{} for _ in range(ws)]

    def one_step(step: int) -> Callable[[int], None]:
        def run(r: int) -> None:
            opts[r].zero_grad()
            loss = _next_token_loss(m.logits(ranks[r](*m.args, **m.kwargs)), m.ids)
            loss.backward()
            if step == 0:
                grads[r] = {n: p.grad.clone() for n, p in ranks[r].named_parameters(remove_duplicate=False)}
            opts[r].step()
            losses[r].append(loss.item())
        return run

    with collectives.record() as events:
        tpcompile.simulate_ranks(ws, one_step(0))
    for step in range(1, steps):
        tpcompile.simulate_ranks(ws, one_step(step))
    return Run(m, sm, ref_losses, ref_grads, losses, grads, list(events))


def _expected_grad(run: Run, name: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rank's slice of the unsharded gradient of `name`, the whole unsharded gradient)."""
    params = dict(run.model.module.named_parameters(remove_duplicate=False))
    # A tied parameter appears in the plan under one of its names; find it by identity.
    plan_name = next(n for n in run.sharded.plan.parameters if params[n] is params[name])
    pp = run.sharded.plan.parameters[plan_name]
    sl = pp.slice()
    full = run.ref_grads[name]
    return local_tensor(full, sl, rank, run.sharded.world_size), full


def _check_gradients(run: Run) -> int:
    """Assert every rank's first gradient equals its slice of the unsharded one; count sliced."""
    names = sorted(run.ref_grads)
    n_sliced = 0
    for r, grads in enumerate(run.grads):
        assert sorted(grads) == names
        for name in names:
            want, full = _expected_grad(run, name, r)
            got = grads[name]
            assert got.shape == want.shape, f"rank {r} {name}: {tuple(got.shape)} vs {tuple(want.shape)}"
            scale = max(float(full.abs().max()), 1e-30)
            err = float((got - want).abs().max()) / scale
            assert err <= TOL, f"rank {r} {name}: max |grad diff| is {err:.3g} of max |grad|"
            n_sliced += want.numel() < full.numel()
    return n_sliced


@pytest.mark.parametrize("name,ws", CASES, ids=IDS)
def test_losses_match_at_every_step(name: str, ws: int) -> None:
    """Every rank's loss equals the unsharded loss within 1e-5 relative at each of 5 AdamW steps."""
    run = _train(name, ws, torch.float64, STEPS)
    assert len(run.ref_losses) == STEPS
    assert run.ref_losses[-1] < run.ref_losses[0] - 0.5  # the steps really train
    for r in range(ws):
        assert len(run.losses[r]) == STEPS
        for step, (got, want) in enumerate(zip(run.losses[r], run.ref_losses)):
            assert abs(got - want) <= TOL * abs(want), f"rank {r} step {step}: {got} vs {want}"


@pytest.mark.parametrize("name,ws", CASES, ids=IDS)
def test_first_gradients_are_slices_of_unsharded(name: str, ws: int) -> None:
    """After the first backward each rank's gradient is its slice of the full one (1e-5)."""
    run = _train(name, ws, torch.float64, STEPS)
    n_sliced = _check_gradients(run)
    # Sliced gradients per rank: GPT's 4 column/row weights and 2 column biases per block,
    # plus the embedding under both of its tied names and the position table (split by rows, its
    # sum added to the token embeddings' before their all-reduce); Llama's 7 projections per block
    # (at 4 ranks the 2 key-value heads are pieces shared by 2 ranks each) plus embedding and head.
    per_rank = {"gpt": 6 * 2 + 3, "llama": 7 * 2 + 2}[name]
    assert n_sliced == per_rank * ws


@pytest.mark.parametrize("name,ws", CASES, ids=IDS)
def test_float32_first_step_matches(name: str, ws: int) -> None:
    """In float32 the first loss (1e-5 relative) and every first gradient slice (1e-5) match."""
    run = _train(name, ws, torch.float32, 1)
    for r in range(ws):
        assert abs(run.losses[r][0] - run.ref_losses[0]) <= TOL * abs(run.ref_losses[0])
    assert _check_gradients(run) > 0


@pytest.mark.parametrize("name,ws", CASES, ids=IDS)
def test_backward_all_reduces(name: str, ws: int) -> None:
    """One backward runs 2 all-reduces per block plus 1 for the head on every rank."""
    run = _train(name, ws, torch.float64, STEPS)
    n_layer = run.model.n_layer
    # Megatron's minimum, per rank, for one backward:
    #   per block, the replicated input of the column-split attention projections and of the
    #   column-split MLP projections gets partial gradients on every rank: 2 all-reduces;
    #   the column-split LM head's replicated input likewise: 1 all-reduce;
    #   the row-split projections' forward all-reduce is the identity in backward: 0;
    #   the vocabulary-split embedding's forward all-reduce is the identity in backward: 0;
    #   the logits gather keeps this rank's chunk of the gradient, without communicating: 0.
    # So 2 * n_layer + 1 = 5 for these 2-layer models.
    expected = Counter({"all_reduce": 2 * n_layer + 1})
    if name == "llama" and ws == 4:
        # 2 key-value heads for 4 ranks: ranks 0-1 hold kv head 0, ranks 2-3 kv head 1. The
        # k_proj and v_proj weight gradients of the ranks sharing a head are summed: one
        # sync each per block, which the default gradient buckets (comm=None) fuse into one
        # all-reduce for these small models.
        assert not run.sharded.plan.replicated
        assert run.sharded.plan.parameters["model.layers.0.self_attn.k_proj.weight"].pieces == 2
        expected["all_reduce"] += 1
    for r in range(ws):
        backward = Counter(e.op for e in run.events if e.rank == r and e.phase == "backward")
        assert backward == expected, f"rank {r}: {dict(backward)}"
        forward = Counter(e.op for e in run.events if e.rank == r and e.phase == "forward")
        assert forward == Counter({"all_reduce": 2 * n_layer + 1, "all_gather_replicated": 1})
