"""Ranks' state dicts merge back into the original model's, after sharded training too."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import tpcompile
from tpcompile.models import GPT, GPTConfig


def _steps(model: torch.nn.Module, idx: torch.Tensor, n: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(n):
        logits = model(idx)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), idx[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("ws,vocab", [(2, 256), (4, 250)])
def test_merge_gives_back_the_original_state(ws: int, vocab: int) -> None:
    """Untrained ranks merge to exactly the original parameters (segments, padding, tied)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab))
    sm = tpcompile.shard(model, ws)
    merged = sm.merge_state_dicts([sm.rank(r).state_dict() for r in range(ws)])
    for name, t in model.state_dict().items():
        torch.testing.assert_close(merged[name], t, atol=0, rtol=0)


def test_merge_after_sharded_training_equals_unsharded_training() -> None:
    """3 SGD steps on 2 simulated ranks, merged, equal 3 steps on the original (float64)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig()).double().train()
    ref = copy.deepcopy(model)
    idx = torch.randint(0, 256, (2, 16))
    sm = tpcompile.shard(model, 2, example_inputs=(idx,))
    ranks = [sm.rank(r) for r in range(2)]
    tpcompile.simulate_ranks(2, lambda r: _steps(ranks[r], idx, 3))
    _steps(ref, idx, 3)
    merged = sm.merge_state_dicts([g.state_dict() for g in ranks])
    trained = copy.deepcopy(model)
    trained.load_state_dict(merged)
    for (name, a), b in zip(trained.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8, msg=name)


def test_merge_needs_every_rank() -> None:
    """Too few state dicts is an error naming the count."""
    sm = tpcompile.shard(GPT(GPTConfig()), 2)
    with pytest.raises(tpcompile.TPCompileError, match="needs 2 state dicts"):
        sm.merge_state_dicts([sm.rank(0).state_dict()])


def test_merge_kv_head_pieces() -> None:
    """Llama with 2 kv heads at 4 ranks: shared kv-head pieces merge back exactly."""
    pytest.importorskip("transformers")
    from hf_models import ARCHS, build, inputs
    arch = next(a for a in ARCHS if a.name == "llama")
    model = build(arch)
    sm = tpcompile.shard(model, 4, example_kwargs=inputs(arch, 2, 8))
    assert sm.plan.parameters["model.layers.0.self_attn.k_proj.weight"].pieces == 2
    merged = sm.merge_state_dicts([sm.rank(r).state_dict() for r in range(4)])
    for name, t in model.state_dict().items():
        torch.testing.assert_close(merged[name], t, atol=0, rtol=0)
