"""tpcompile.profile over real gloo ranks: a parallelize() module's training loop and (slow) a pipelined HybridModel."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tpcompile.runtime import launch

pytestmark = pytest.mark.gloo
CONFIG = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)


def _loss(out: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Cross entropy of the logits against the ids."""
    return F.cross_entropy(out.flatten(0, 1), ids.flatten())


def _rank(rank: int, trace: str) -> dict[str, Any]:
    """Profile 3 training steps of a tiny GPT's rank module in its own loop."""
    import tpcompile
    from tpcompile.models import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CONFIG)).train()
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    local = tpcompile.parallelize(model, example_inputs=(ids,))
    plain = local(ids).detach()
    own = local.__dict__.get("forward")  # its dispatch of refused input shapes (runtime/shape_cache.py)
    opt = torch.optim.AdamW(local.parameters())
    with tpcompile.profile(local) as prof:
        first = local(ids).detach()  # the instrumented forward computes what the plain one does
        for _ in range(3):
            with prof.region("loss"):
                loss = _loss(local(ids), ids)
            loss.backward()
            with prof.region("optimizer"):
                opt.step()
                opt.zero_grad()
            prof.step()
    tp = prof.report(model="tiny gpt").data
    prof.save_trace(trace)
    return {"tp": tp, "same": bool(torch.equal(plain, first)), "restored": local.__dict__.get("forward") is own
            and getattr(own, "graph_forward", None) is None}


def _pipeline_rank(rank: int) -> dict[str, Any]:
    """Profile 2 steps of the tiny GPT on 2 pipeline stages (a HybridModel, 2 microbatches)."""
    import tpcompile
    from tpcompile.models import GPT, GPTConfig
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    hm = tpcompile.parallelize_train(GPT(GPTConfig(**CONFIG)).train(), tpcompile.init_mesh(pp=2), loss_fn=_loss,
                                     example_inputs=(ids,), microbatches=2, data_parallel="ddp")
    hm.step(ids, target=ids)  # warm-up: the schedule is built on the first step
    with tpcompile.profile(hm) as prof:
        for _ in range(2):
            hm.step(ids, target=ids)
            prof.step()
    return prof.report().data


@pytest.fixture(scope="module")
def results() -> tuple[list[dict], dict]:
    """One launch of both ranks; their results and the merged trace."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        got = launch(2, _rank, str(path), timeout=300)
        return got, json.loads(path.read_text())


def test_rank_module_profile_names_every_block_and_collective(results: tuple[list[dict], dict]) -> None:
    """Both layers, their forward all-reduces and backward ones by module path, waits within each call's time;
    the parts add up to the step, the forward is unchanged under the profile and restored after it."""
    ranks, _ = results
    assert all(r["same"] and r["restored"] for r in ranks)
    data = ranks[0]["tp"]
    assert data == ranks[1]["tp"]  # the report is gathered: every rank gets the same one
    blocks = {b["block"]: b for b in data["blocks"]}
    assert {"pre", "transformer.h.0", "transformer.h.1", "post", "loss", "optimizer"} <= set(blocks)
    h1 = blocks["transformer.h.1"]
    assert h1["compute_ms"] > 0 and h1["kind"] == "block"
    calls = {(c["op"], c["phase"], c["module"]) for c in h1["collectives"]}
    assert {("all_reduce", "forward", "transformer.h.1.attn.c_proj"), ("all_reduce", "forward",
            "transformer.h.1.mlp.c_proj"), ("all_reduce", "backward", "transformer.h.1.attn.c_attn")} <= calls
    for c in h1["collectives"]:
        assert c["bytes"] == 4 * 16 * 32 * 4 and 0 <= c["wait_ms"] <= c["ms"]
    assert data["accounted_ms"] + data["other_ms"] == pytest.approx(data["step_ms"], abs=1e-3)
    assert data["accounted_ms"] >= 0.85 * data["step_ms"]


def test_merged_trace_labels_collectives(results: tuple[list[dict], dict]) -> None:
    """One Chrome trace of both ranks: every tpcompile collective op event carries its module path and phase."""
    _, trace = results
    events = trace["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}
    ops = [e for e in events if e["name"] == "tpcompile::all_reduce"]
    assert ops and all(e["args"]["module"].startswith(("transformer.", "lm_head")) for e in ops)
    assert {e["args"]["phase"] for e in ops} == {"forward", "backward"}


@pytest.mark.slow
def test_hybrid_model_profile_has_stages_blocks_and_bubble() -> None:
    """A 2-stage pipeline: each rank's blocks are its stage's layers, and the pipeline's waiting is measured."""
    data = launch(2, _pipeline_rank, timeout=300)[0]
    blocks = {b["block"] for b in data["blocks"]}
    assert {"transformer.h.0", "transformer.h.1"} <= blocks
    assert data["bubble_ms"] > 0
    per_rank = {r["rank"]: r["steps"] for r in data["ranks"]}
    assert per_rank == {0: 2, 1: 2}
