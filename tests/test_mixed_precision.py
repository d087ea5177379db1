"""Mixed precision: compute in bf16/fp16, float32 master weights, optimizer state and gradient reductions.

The capture twin and the rank-graph pass are checked in-process (simulated ranks against the same
policy in one process); the runtimes in one 2-rank gloo launch (tests/precision_run.py); the layouts
of the issue under `pytest -m hybrid` (tests/test_hybrid_matrix.py).
"""
from __future__ import annotations

import pytest
import torch
from torch.func import functional_call

import tpcompile
from precision_run import gpt, results
from tpcompile.capture.precision import compute_dtype, compute_twin, float32_masters, full_state
from tpcompile.checkpoint.weights import load_rank_weights
from tpcompile.ops.collectives import record
from tpcompile.passes.mixed_precision import mixed_precision_pass

RTOL = 1e-2  # bf16 against the same policy in one process


def test_unknown_policy_is_refused() -> None:
    """mixed_precision='fp8' is a TPCompileError naming the accepted values."""
    with pytest.raises(tpcompile.TPCompileError, match="'bf16', 'fp16'"):
        compute_dtype("fp8")


def test_twin_is_meta_in_the_compute_dtype_and_leaves_the_model_alone() -> None:
    """The twin's parameters are bf16 on meta, its buffers keep their dtype; the model is untouched."""
    model = gpt()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    twin = compute_twin(model, torch.bfloat16)
    assert {(p.device.type, p.dtype) for p in twin.parameters()} == {("meta", torch.bfloat16)}
    assert all(b.is_meta for b in twin.buffers())
    assert twin.lm_head.weight is twin.transformer.wte.weight  # ties survive
    assert all(torch.equal(before[n], t) and t.dtype == torch.float32 for n, t in model.state_dict().items())


def _ranks(model: torch.nn.Module, ws: int, dtype: torch.dtype, ids: torch.Tensor) -> tpcompile.ShardedModel:
    """Rank graphs in the policy, as parallelize builds them: twin captured, float32 masters filled, pass run."""
    sm = tpcompile.shard(compute_twin(model, dtype), ws, example_inputs=(ids.to("meta"),), sequence_parallel=True)
    state = full_state(model)
    for r in range(ws):
        gm = sm.rank(r)
        float32_masters(gm)
        mixed_precision_pass(gm, dtype)
        load_rank_weights(gm, sm, r, state)
    return sm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_simulated_ranks_follow_the_policy(dtype: torch.dtype) -> None:
    """At 2 ranks: the loss of the one-process policy, float32 gradients, parameter-gradient sums in float32."""
    model, ids = gpt(), torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    sm = _ranks(model, 2, dtype, ids)

    def run(r: int) -> tuple:
        gm = sm.rank(r)
        with record() as events:
            loss = gm(ids).float().square().mean()
            loss.backward()
        return (loss.item(), {p.grad.dtype for p in gm.parameters()},
                [e for e in events if e.phase == "backward" and e.rank == r])  # (record() hears every thread)
    outs = tpcompile.simulate_ranks(2, run)
    params = {n: p.to(dtype) for n, p in model.named_parameters()}
    want = functional_call(model, params, (ids,)).float().square().mean().item()
    for loss, grads, events in outs:
        assert abs(loss - want) <= RTOL * abs(want)
        assert grads == {torch.float32}
        sizes = {(len(e.shape), e.nbytes // max(1, int(torch.Size(e.shape).numel()))) for e in events}
        assert (1, 4) in sizes  # replicated norm weights' gradients summed in float32 (a bucket of 1-d gradients)
        assert all(k == 2 for rank, k in sizes if rank == 3)  # activation gradients stay in the compute dtype


def _close(a: list[float], b: list[float], rtol: float = RTOL) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rtol * abs(y) for x, y in zip(a, b))


@pytest.mark.gloo
@pytest.mark.parametrize("policy", ["bf16", "fp16"])
def test_parallelize_follows_the_policy(policy: str) -> None:
    """parallelize(mixed_precision=...): the policy's losses, float32 weights, gradients and AdamW state."""
    for r in results():
        got = r["parallelize"][policy]
        assert _close(got["losses"], r["reference"][policy]), (got["losses"], r["reference"][policy])
        assert got["params"] == got["grads"] == got["optimizer"] == ["torch.float32"]
        assert (1, 4) in got["backward_syncs"] and all(k == 2 for d, k in got["backward_syncs"] if d == 3)


@pytest.mark.gloo
def test_fsdp_gathers_in_bf16_and_reduces_in_float32() -> None:
    """FSDP at dp 2: all-gathers bf16, reduce-scatters float32, AdamW state float32, the policy's losses."""
    for r in results():
        got = r["fsdp_bf16"]
        assert got["seen"] == {"all_gather": ["torch.bfloat16"], "reduce_scatter": ["torch.float32"]}
        assert got["optimizer"] == got["params"] == ["torch.float32"]
        assert _close(got["losses"], r["reference"]["bf16"]), (got["losses"], r["reference"]["bf16"])


@pytest.mark.gloo
def test_ddp_keeps_float32_parameters() -> None:
    """DDP at dp 2: float32 parameters cast in the graph, the policy's losses."""
    for r in results():
        got = r["ddp_bf16"]
        assert got["params"] == got["optimizer"] == ["torch.float32"]
        assert got["seen"]["reduce_scatter"] == []  # (no FSDP)
        assert _close(got["losses"], r["reference"]["bf16"]), (got["losses"], r["reference"]["bf16"])


@pytest.mark.gloo
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank() -> None:
    """fp16 at tp 2, an inf in one gradient of rank 1 at step 2: both ranks skip it, halve the scale, move no weight."""
    a, b = (r["tp_fp16_inf"] for r in results())
    assert a["skipped"] == b["skipped"] == [False, True, False]
    assert a["moved"] == b["moved"] == [True, False, True]
    assert a["scale"] == b["scale"] == 2.0 ** 15

