"""Parameters kept whole but applied to split activations get whole, equal gradients."""
from __future__ import annotations

import copy

import pytest
import torch

import tpcompile

pytest.importorskip("transformers")
from hf_models import Arch, build, inputs, qwen3  # noqa: E402

QWEN3 = Arch("qwen3", qwen3, "logits")


@pytest.mark.parametrize("ws", [2, 4])
def test_per_head_norm_weights_get_the_full_gradient(ws: int) -> None:
    """Qwen3's q_norm / k_norm weights act on each rank's heads; every rank gets the full gradient."""
    model = build(QWEN3).train()
    ref = copy.deepcopy(model)
    kw = inputs(QWEN3, 2, 8)
    sm = tpcompile.shard(model, ws, example_kwargs=kw)
    assert sm.plan.modules["model.layers.0.self_attn.q_proj"] == "column"
    ranks = [sm.rank(r) for r in range(ws)]
    ref(**kw).logits.float().pow(2).mean().backward()
    want = {n: p.grad for n, p in ref.named_parameters()}

    def grads(r: int) -> dict:
        ranks[r](**kw).logits.float().pow(2).mean().backward()
        return {n: p.grad for n, p in ranks[r].named_parameters()}

    per_rank = tpcompile.simulate_ranks(ws, grads)
    names = [n for n in want if "q_norm" in n or "k_norm" in n]
    assert len(names) == 4
    for name in names:
        assert sm.plan.parameters[name].role == "replicated"
        for got in per_rank:
            torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-4)
    # and the forward still equals the original
    kw2 = inputs(QWEN3, 3, 13)
    with torch.no_grad():
        out = tpcompile.simulate(sm, **kw2)
        torch.testing.assert_close(out[0].logits, model(**kw2).logits, atol=1e-4, rtol=0)
