"""Real torch.distributed runs: launch() with gloo processes, and init_from_env in this process."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tpcompile.errors import TPCompileError
from tpcompile.ops import collectives as C
from tpcompile.runtime import backends
from tpcompile.runtime import DEFAULT_TIMEOUT_S, collective_timeout, free_port, init_from_env, launch

pytestmark = pytest.mark.gloo

DIMS = (0, 1)


def _x(rank: int) -> torch.Tensor:
    """Rank r's input: (4, 6) values that differ per rank."""
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(200 + rank))


def _g(rank: int, shape: torch.Size) -> torch.Tensor:
    """Rank r's upstream gradient of the given shape."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(300 + rank))


def _all_ops(rank: int) -> dict:
    """Run every collective forward and backward on this rank; {(op, dim): (out, grad_in)}."""
    results = {}
    for name in C.COLLECTIVE_OPS:
        for dim in DIMS:
            x = _x(rank).requires_grad_()
            op = getattr(torch.ops.tpcompile, name).default
            two_args = name in ("all_reduce", "grad_all_reduce")
            y = op(x, "default") if two_args else op(x, dim, "default")
            (gx,) = torch.autograd.grad(y, x, _g(rank, y.shape))
            results[(name, dim)] = (y, gx)
    return results


def _expected(name: str, dim: int, rank: int, ws: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Hand-computed (output, input gradient) of op name on rank out of ws."""
    xs = [_x(r) for r in range(ws)]
    own = lambda t: t.chunk(ws, dim)[rank]  # noqa: E731
    shape = list(xs[0].shape)
    if name in ("all_gather", "all_gather_replicated"):
        shape[dim] *= ws
    elif name in ("reduce_scatter", "scatter"):
        shape[dim] //= ws
    gs = [_g(r, torch.Size(shape)) for r in range(ws)]
    rules = {
        "all_reduce": lambda: (sum(xs), gs[rank]),
        "all_gather": lambda: (torch.cat(xs, dim), sum(own(g) for g in gs)),
        "reduce_scatter": lambda: (sum(own(x) for x in xs), torch.cat(gs, dim)),
        "all_gather_replicated": lambda: (torch.cat(xs, dim), own(gs[rank])),
        "grad_all_reduce": lambda: (xs[rank], sum(gs)),
        "scatter": lambda: (own(xs[rank]), torch.cat(gs, dim)),
    }
    return rules[name]()


def _fail_on_rank_1(rank: int) -> float:
    """Rank 1 raises; rank 0 waits in an all_reduce that can never complete."""
    if rank == 1:
        raise ValueError("deliberate failure")
    return C.all_reduce(torch.ones(1), "default").item()


@pytest.fixture(scope="module")
def two_rank_results() -> list[dict]:
    """Every op forward and backward on 2 real gloo processes (one launch shared by the tests)."""
    return launch(2, _all_ops, timeout=30)


@pytest.mark.parametrize("name", C.COLLECTIVE_OPS)
def test_ops_on_two_gloo_processes(two_rank_results: list[dict], name: str) -> None:
    """Under gloo at world size 2, each op's output and gradient equal the Megatron reference."""
    for rank, results in enumerate(two_rank_results):
        for dim in DIMS:
            y, gx = results[(name, dim)]
            want_y, want_gx = _expected(name, dim, rank, 2)
            torch.testing.assert_close(y, want_y)
            torch.testing.assert_close(gx, want_gx)


def test_failing_rank_is_named_with_traceback() -> None:
    """launch raises TPCompileError naming rank 1 and its traceback, and kills rank 0 quickly."""
    start = time.monotonic()
    with pytest.raises(TPCompileError, match="rank 1 failed:(.|\n)*deliberate failure"):
        launch(2, _fail_on_rank_1, timeout=30)
    assert time.monotonic() - start < 20


def test_unpicklable_fn_is_rejected() -> None:
    """A lambda cannot reach a spawned process, so launch says fn must be module-level."""
    with pytest.raises(TPCompileError, match="module-level"):
        launch(1, lambda r: r)
    with pytest.raises(TPCompileError, match="int >= 1"):
        launch(0, _all_ops)


def test_init_from_env_and_collectives_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """init_from_env starts a 1-rank gloo group; ops then run on it, registered groups too."""
    assert not dist.is_initialized()
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    try:
        assert init_from_env() == (0, 1)
        assert init_from_env() == (0, 1)
        C.register_group("tp", dist.new_group([0]))
        x = torch.arange(6.0).reshape(2, 3).requires_grad_()
        with C.record() as events:
            y = C.all_gather(C.grad_all_reduce(x, "tp"), 1, "tp")
            y.sum().backward()
        torch.testing.assert_close(y, x.detach())
        torch.testing.assert_close(x.grad, torch.ones(2, 3))
        assert [(e.op, e.phase) for e in events] == [
            ("all_gather", "forward"), ("reduce_scatter", "backward"), ("all_reduce", "backward")]
        assert (C.world_size_of("default"), C.rank_of("tp")) == (1, 0)
        # a one-rank group has nothing to exchange: every op returns a fresh copy without calling gloo
        for fn in ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor"):
            monkeypatch.setattr(dist, fn, lambda *a, _fn=fn, **k: pytest.fail(f"dist.{_fn} on a one-rank group"))
        for fn in ("_gather_single", "_scatter_single"):
            monkeypatch.setattr(backends, fn, lambda *a, _fn=fn, **k: pytest.fail(f"{_fn} on a one-rank group"))
        w = torch.arange(6.0).reshape(2, 3)
        for out in (C.all_reduce(w, "tp"), C.all_gather(w, 0, "tp"), C.reduce_scatter(w, 1, "tp")):
            torch.testing.assert_close(out, w)
            assert out.data_ptr() != w.data_ptr()
        with pytest.raises(TPCompileError, match="no process group registered under 'other'"):
            C.all_reduce(x, "other")
    finally:
        C.unregister_group("tp")
        dist.destroy_process_group()


def test_init_from_env_without_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without torchrun's variables init_from_env raises TPCompileError naming them."""
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(TPCompileError, match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"):
        init_from_env()


def test_collective_timeout_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """TPCOMPILE_TIMEOUT_S sets the group timeout (default DEFAULT_TIMEOUT_S); a bad value is named."""
    monkeypatch.delenv("TPCOMPILE_TIMEOUT_S", raising=False)
    assert collective_timeout() == timedelta(seconds=DEFAULT_TIMEOUT_S)
    monkeypatch.setenv("TPCOMPILE_TIMEOUT_S", "12.5")
    assert collective_timeout() == timedelta(seconds=12.5)
    for bad in ("0", "soon"):
        monkeypatch.setenv("TPCOMPILE_TIMEOUT_S", bad)
        with pytest.raises(TPCompileError, match=f"TPCOMPILE_TIMEOUT_S='{bad}'"):
            collective_timeout()


def test_init_from_env_standalone(monkeypatch: pytest.MonkeyPatch) -> None:
    """standalone=True without torchrun's variables starts a one-rank gloo group with the timeout set."""
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.setenv(key, "x")  # recorded as absent, so the test leaves the environment as it was
        monkeypatch.delenv(key)
    monkeypatch.setenv("TPCOMPILE_TIMEOUT_S", "42")
    assert not dist.is_initialized()
    try:
        assert init_from_env(standalone=True) == (0, 1)
        assert dist.get_backend() == "gloo"
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        assert backend.options._timeout == timedelta(seconds=42)
    finally:
        dist.destroy_process_group()
