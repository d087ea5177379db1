"""sequence_parallel=True: token-split norms and residuals, same numerics, less activation memory."""
from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F

import tpcompile
from tpcompile.models import build
from tpcompile.ops.collectives import record

GPTS = ["gpt", "gpt-manual", "gpt-sep"]


def _idx(b: int, t: int) -> torch.Tensor:
    return torch.randint(0, 256, (b, t))


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("name", GPTS)
def test_sp_ranks_equal_original(name: str, ws: int) -> None:
    """With sequence parallelism every rank's logits equal the original (1e-5)."""
    model = build(name)
    sm = tpcompile.shard(model, ws, sequence_parallel=True)
    for b, t in ((2, 16), (3, 24)):
        idx = _idx(b, t)
        with torch.no_grad():
            ref = model(idx)
            for out in tpcompile.simulate(sm, idx):
                torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("ws", [2, 4])
def test_sp_forward_uses_only_gather_and_reduce_scatter(ws: int) -> None:
    """Each block: all-gather into and reduce-scatter out of attention and MLP; no all-reduce."""
    sm = tpcompile.shard(build("gpt"), ws, sequence_parallel=True)
    blocks: dict[str, list[str]] = {}
    for op, path in sm.collectives():
        m = re.match(r"transformer\.h\.(\d+)", path)
        if m:
            blocks.setdefault(m.group(1), []).append(op)
    assert blocks == {b: ["all_gather", "reduce_scatter", "all_gather", "reduce_scatter"] for b in ("0", "1")}
    ops = [op for op, _ in sm.collectives()]
    assert "all_reduce" not in ops
    assert ops[0] == "reduce_scatter" and ops[-1] == "all_gather_replicated"  # embedding, logits


def _train(model_or_rank: torch.nn.Module, batches: list, steps: int) -> tuple[list[float], dict]:
    """AdamW steps of next-token loss; returns the losses and the first step's gradients."""
    opt = torch.optim.AdamW(model_or_rank.parameters(), lr=1e-2)
    losses, first = [], {}
    for step in range(steps):
        idx = batches[step % len(batches)]
        logits = model_or_rank(idx)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), idx[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        if step == 0:
            first = {n: p.grad.clone() for n, p in model_or_rank.named_parameters()}
        opt.step()
        losses.append(loss.item())
    return losses, first


@pytest.mark.parametrize("ws", [2, 4])
def test_sp_training_matches_unsharded(ws: int) -> None:
    """5 AdamW steps with sequence parallelism: losses equal the unsharded run (1e-5 relative)."""
    model = build("gpt").train()
    ref_model = copy.deepcopy(model)
    sm = tpcompile.shard(model, ws, sequence_parallel=True)
    ranks = [sm.rank(r) for r in range(ws)]
    batches = [_idx(4, 16), _idx(4, 16)]
    ref_losses, ref_grads = _train(ref_model, batches, 5)
    results = tpcompile.simulate_ranks(ws, lambda r: _train(ranks[r], batches, 5))
    for losses, grads in results:
        for a, b in zip(losses, ref_losses):
            assert abs(a - b) <= 1e-5 * abs(b)
        # replicated norm weights: gradients summed over all tokens, equal to the full gradient
        torch.testing.assert_close(grads["transformer.ln_f.weight"], ref_grads["transformer.ln_f.weight"], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(grads["transformer.h.0.attn.c_proj.bias"], ref_grads["transformer.h.0.attn.c_proj.bias"], atol=1e-5, rtol=1e-4)


def test_sp_backward_communicates_activations_by_gather_and_reduce_scatter() -> None:
    """Backward moves activations only by reduce-scatter / all-gather; all-reduces are parameter gradients."""
    sm = tpcompile.shard(build("gpt").train(), 2, sequence_parallel=True)
    ranks = [sm.rank(r) for r in range(2)]
    idx = _idx(2, 16)

    def step(r: int) -> None:
        ranks[r](idx).float().pow(2).mean().backward()

    with record() as events:
        tpcompile.simulate_ranks(2, step)
    back = [e for e in events if e.phase == "backward" and e.rank == 0]
    kinds = {e.op for e in back}
    assert kinds <= {"all_gather", "reduce_scatter", "all_reduce"}
    assert sum(e.op == "reduce_scatter" for e in back) == 5  # conjugate of each forward all-gather
    # conjugate of each forward reduce-scatter, plus one for the position embedding: each rank
    # adds only its tokens' rows of it, so its gradient is gathered back
    assert sum(e.op == "all_gather" for e in back) == 5 + 1
    for e in back:
        if e.op == "all_reduce":
            assert len(e.shape) == 1, f"activation all-reduce in backward: {e}"  # norm weights / biases


def _saved_bytes(module: torch.nn.Module, idx: torch.Tensor) -> int:
    """Bytes of activations autograd keeps for backward in one forward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(idx).sum()
    return sum(seen.values())


def test_sp_saves_activation_memory() -> None:
    """Activation bytes kept per rank shrink with sequence parallelism; the numbers are printed (pytest -s)."""
    model = build("gpt").train()
    idx = _idx(4, 32)
    full = _saved_bytes(copy.deepcopy(model), idx)
    rows = []
    for ws in (2, 4):
        measured = {}
        for sp in (False, True):
            sm = tpcompile.shard(model, ws, sequence_parallel=sp)
            ranks = [sm.rank(r) for r in range(ws)]
            measured[sp] = tpcompile.simulate_ranks(ws, lambda r: _saved_bytes(ranks[r], idx))[0]
        rows.append((ws, measured[False], measured[True]))
        assert measured[True] < measured[False] < full
    # captured by pytest (not in the -q output): shown with -s, or in the report of a failure
    print(f"\nactivation bytes kept for backward per rank, bundled GPT, batch 4 x 32 tokens: unsharded {full:,}")
    for ws, tp_only, sp in rows:
        print(f"  world size {ws}: tensor parallel {tp_only:,}; + sequence parallel {sp:,} "
              f"(saves {tp_only - sp:,} bytes, {100 * (tp_only - sp) / tp_only:.0f}%)")


@pytest.mark.parametrize("ws", [2, 4])
def test_sp_llama_trains_like_the_original(ws: int) -> None:
    """Hugging Face Llama with sequence parallelism: same logits, and 5 AdamW steps give the same losses."""
    pytest.importorskip("transformers")
    from hf_models import ARCHS
    from hf_models import build as build_hf

    arch = next(a for a in ARCHS if a.name == "llama")
    model = build_hf(arch).train()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 16))
    kw = {"input_ids": ids, "use_cache": False}
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tpcompile.TPCompileWarning)  # kv heads at 4 ranks
        sm = tpcompile.shard(model, ws, example_kwargs=kw, sequence_parallel=True)
    ops = {op for op, _ in sm.collectives()}
    assert ops <= {"all_gather", "reduce_scatter", "all_gather_replicated"}
    ranks = [sm.rank(r) for r in range(ws)]

    def train(m: torch.nn.Module) -> list[float]:
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        losses = []
        for _ in range(5):
            logits = m(**kw).logits
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, 128), ids[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    want = train(ref)
    for got in tpcompile.simulate_ranks(ws, lambda r: train(ranks[r])):
        for a, b in zip(got, want):
            assert abs(a - b) <= 1e-5 * abs(b)
