"""The bundled examples sharded at world size 2 and run on real gloo processes.

Every rank process builds and shards the model itself, as under torchrun, and compares its
output with the unsharded model computed in the same process. All checks share one
launch(2, ...) so the file pays for process start-up and rendezvous only once.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tpcompile
from tpcompile.models import build
from tpcompile.ops import collectives
from tpcompile.passes.rank_module import local_tensor
from tpcompile.placement import ParamSlice
from tpcompile.runtime import launch
from tpcompile.runtime.backends import DistBackend

pytestmark = pytest.mark.gloo

WS = 2
TOL = 1e-5
# (model, sequence_parallel, input shapes): the example shape first, then a new batch and length.
CASES = [
    ("mlp", False, [(4, 64), (9, 64)]),
    ("gpt", False, [(2, 16), (3, 37)]),
    ("gpt-manual", False, [(2, 16), (3, 37)]),
    ("gpt-sep", False, [(2, 16), (3, 37)]),
    ("gpt", True, [(2, 16), (3, 24), (2, 7)]),  # sequence parallel: 7 tokens in shares of 4|3
]
TRAIN_SHAPE = (4, 16)


def _input(name: str, shape: tuple[int, int], seed: int) -> torch.Tensor:
    """The same input on every process: floats for the MLP, token ids < 256 for the GPTs."""
    gen = torch.Generator().manual_seed(seed)
    if name == "mlp":
        return torch.randn(shape, generator=gen)
    return torch.randint(0, 256, shape, generator=gen)


def _shard(model: torch.nn.Module, **kwargs: object) -> tpcompile.ShardedModel:
    """shard() at world size WS on this process's own copy of the model."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tpcompile.TPCompileWarning)
        return tpcompile.shard(model, WS, **kwargs)


def _examples(rank: int) -> dict:
    """For each case and shape: (max |rank output - unsharded|, output shape, collectives run)."""
    out = {}
    for name, sp, shapes in CASES:
        model = build(name)
        sm = _shard(model, example_inputs=model.example_inputs(), sequence_parallel=sp)
        gm = sm.rank(rank)
        for i, shape in enumerate(shapes):
            x = model.example_inputs()[0] if i == 0 else _input(name, shape, seed=10 + i)
            assert tuple(x.shape) == shape
            with torch.no_grad(), collectives.record() as events:
                got = gm(x)
                ref = model(x)
            assert got.shape == ref.shape, f"{name} {shape}: {tuple(got.shape)} vs {tuple(ref.shape)}"
            out[(name, sp, shape)] = (float((got - ref).abs().max()), tuple(got.shape),
                                      len(events))
    return out


def _next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of predicting token t+1 from positions <= t."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _train_step(rank: int) -> dict:
    """One forward+backward of "gpt" in train mode: per parameter (rank grad, expected slice)."""
    model = build("gpt").train()
    sm = _shard(model, example_inputs=model.example_inputs())
    gm = sm.rank(rank)
    ids = _input("gpt", TRAIN_SHAPE, seed=1)

    ref_loss = _next_token_loss(model(ids), ids)
    ref_loss.backward()
    loss = _next_token_loss(gm(ids), ids)
    loss.backward()

    params = dict(model.named_parameters(remove_duplicate=False))
    grads = {}
    for name, p in gm.named_parameters(remove_duplicate=False):
        # a tied parameter is in the plan under one of its names: find it by identity
        plan_name = next(n for n in sm.plan.parameters if params[n] is params[name])
        pp = sm.plan.parameters[plan_name]
        sl = None if pp.dim is None else ParamSlice(pp.dim, pp.segments)
        full = params[name].grad
        grads[name] = (p.grad.clone(), local_tensor(full, sl, rank, WS), tuple(full.shape))
    return {"loss": (loss.item(), ref_loss.item()), "grads": grads}


def _child(rank: int) -> dict:
    """Everything one rank process checks, plus proof that it ran on gloo as rank `rank`."""
    torch.manual_seed(0)
    backend = collectives.current_backend("default")
    return {
        "rank": rank,
        "dist": (dist.get_rank(), dist.get_world_size(), dist.get_backend()),
        "backend": type(backend).__name__,
        "examples": _examples(rank),
        "train": _train_step(rank),
    }


@pytest.fixture(scope="module")
def gloo_results() -> list[dict]:
    """One launch(2, ...) shared by every test in this file."""
    return launch(WS, _child, timeout=120)


def test_both_ranks_ran_on_gloo(gloo_results: list[dict]) -> None:
    """Two results in rank order, each from a gloo process group of size 2 via DistBackend."""
    assert len(gloo_results) == WS
    for r, res in enumerate(gloo_results):
        assert res["rank"] == r
        assert res["dist"] == (r, WS, "gloo")
        assert res["backend"] == DistBackend.__name__


@pytest.mark.parametrize("name,sp,shapes", CASES,
                         ids=[f"{n}{'-sp' if sp else ''}" for n, sp, _ in CASES])
def test_examples_match_unsharded(gloo_results: list[dict], name: str, sp: bool,
                                  shapes: list) -> None:
    """Each rank's output equals the unsharded model within 1e-5 on every shape, via collectives."""
    for r, res in enumerate(gloo_results):
        for shape in shapes:
            diff, out_shape, n_collectives = res["examples"][(name, sp, shape)]
            assert diff <= TOL, f"rank {r} {name} sp={sp} {shape}: max diff {diff:.3g}"
            want = (shape[0], 64) if name == "mlp" else (*shape, 256)
            assert out_shape == want
            assert n_collectives > 0, f"rank {r} {name} {shape}: no collective ran"


def test_train_step_gradients_are_slices(gloo_results: list[dict]) -> None:
    """After one train-mode backward each rank's gradients equal its slice of the unsharded ones."""
    names = sorted(gloo_results[0]["train"]["grads"])
    assert len(names) > 0
    for r, res in enumerate(gloo_results):
        loss, ref_loss = res["train"]["loss"]
        assert abs(loss - ref_loss) <= TOL * abs(ref_loss)
        grads = res["train"]["grads"]
        assert sorted(grads) == names
        n_sliced = 0
        for name in names:
            got, want, full_shape = grads[name]
            assert got.shape == want.shape, f"rank {r} {name}: {tuple(got.shape)} vs {tuple(want.shape)}"
            diff = float((got - want).abs().max())
            assert diff <= TOL, f"rank {r} {name}: max |grad diff| {diff:.3g}"
            n_sliced += want.numel() < torch.Size(full_shape).numel()
        # 6 sliced tensors per block (2 blocks), the tied embedding under both names, the position table
        assert n_sliced == 6 * 2 + 3
