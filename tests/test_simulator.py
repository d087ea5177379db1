"""The in-process simulator: threads as ranks, backward on the rank thread, failures never hang."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from tpcompile.errors import TPCompileError
from tpcompile.ops import collectives as C
from tpcompile.runtime.simulator import simulate, simulate_ranks


class MLP(nn.Module):
    """The unsharded reference: Linear -> ReLU -> Linear."""

    def __init__(self) -> None:
        """Two small linear layers with fixed weights."""
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = nn.Linear(6, 8), nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 6) -> (B, 6)."""
        return self.down(torch.relu(self.up(x)))


class MegatronMLP(nn.Module):
    """One rank of the Megatron MLP: column-split up, row-split down, bias after the reduce."""

    def __init__(self, ref: MLP, rank: int, world_size: int) -> None:
        """Slice ref's weights for rank."""
        super().__init__()
        n = 8 // world_size
        rows = slice(rank * n, (rank + 1) * n)
        self.w_up = nn.Parameter(ref.up.weight.detach()[rows].clone())
        self.b_up = nn.Parameter(ref.up.bias.detach()[rows].clone())
        self.w_down = nn.Parameter(ref.down.weight.detach()[:, rows].clone())
        self.b_down = nn.Parameter(ref.down.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 6) replicated -> (B, 6) replicated."""
        x = torch.ops.tpcompile.grad_all_reduce.default(x, "default")
        h = torch.relu(x @ self.w_up.T + self.b_up)
        return torch.ops.tpcompile.all_reduce.default(h @ self.w_down.T, "default") + self.b_down


@dataclass
class FakeSharded:
    """The two ShardedModel members simulate() uses: world_size and rank(r)."""

    world_size: int
    ranks: list[torch.fx.GraphModule]

    def rank(self, r: int) -> torch.fx.GraphModule:
        """The graph of rank r."""
        return self.ranks[r]


def test_results_come_back_in_rank_order() -> None:
    """simulate_ranks returns fn(rank) for ranks 0..n-1 in order."""
    assert simulate_ranks(3, lambda r: r * 10) == [0, 10, 20]


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "2"])
def test_world_size_must_be_positive_int(bad: object) -> None:
    """A world size that is not an int >= 1 raises TPCompileError."""
    with pytest.raises(TPCompileError, match="int >= 1"):
        simulate_ranks(bad, lambda r: r)  # type: ignore[arg-type]


def test_backward_runs_on_the_rank_thread() -> None:
    """CPU autograd runs backward hooks on the thread that called backward, so ranks stay known."""
    def run(rank: int) -> tuple[bool, int]:
        x = torch.ones(2, requires_grad=True)
        seen: list[tuple[int, int]] = []
        x.register_hook(lambda g: seen.append((threading.get_ident(), C.rank_of("default"))))
        (x * 2).sum().backward()
        return seen[0][0] == threading.get_ident(), seen[0][1]

    assert simulate_ranks(2, run) == [(True, 0), (True, 1)]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_megatron_mlp_matches_reference_forward_and_backward(world_size: int) -> None:
    """Traced Megatron MLP ranks reproduce the MLP's output and gradients with 1+1 all-reduces."""
    ref = MLP()
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    xr = x.clone().requires_grad_()
    want = ref(xr)
    want.square().sum().backward()
    ranks = [torch.fx.symbolic_trace(MegatronMLP(ref, r, world_size)) for r in range(world_size)]

    def run(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        xi = x.clone().requires_grad_()
        out = ranks[rank](xi)
        out.square().sum().backward()
        return out.detach(), xi.grad, ranks[rank].w_up.grad

    with C.record() as events:
        outs = simulate_ranks(world_size, run)
    n = 8 // world_size
    for rank, (out, gx, gw) in enumerate(outs):
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(gx, xr.grad)
        torch.testing.assert_close(gw, ref.up.weight.grad[rank * n:(rank + 1) * n])
    for phase in ("forward", "backward"):
        got = sorted(e.rank for e in events if e.phase == phase)
        assert got == list(range(world_size)), phase
    assert {e.op for e in events} == {"all_reduce"}


def test_simulate_runs_each_rank_graph() -> None:
    """simulate(sharded, x) calls rank r's module on x and returns outputs in rank order."""
    ref = MLP()
    x = torch.randn(3, 6)
    sharded = FakeSharded(2, [torch.fx.symbolic_trace(MegatronMLP(ref, r, 2)) for r in range(2)])
    outs = simulate(sharded, x)
    assert len(outs) == 2
    for out in outs:
        torch.testing.assert_close(out, ref(x))


def test_sequence_parallel_pair_counts() -> None:
    """all_gather then reduce_scatter along the sequence costs one of each per rank per phase."""
    x = torch.randn(2, 8, 4)

    def run(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        xs = C.scatter(x, 1, "default").requires_grad_()
        full = C.all_gather(xs, 1, "default") * 3.0
        out = C.reduce_scatter(full, 1, "default")
        out.sum().backward()
        return out.detach(), xs.grad

    with C.record() as events:
        outs = simulate_ranks(4, run)
    for rank, (out, g) in enumerate(outs):
        torch.testing.assert_close(out, x.chunk(4, 1)[rank] * 12.0)
        torch.testing.assert_close(g, torch.full_like(g, 12.0))
    counts = {}
    for e in events:
        counts[(e.op, e.phase)] = counts.get((e.op, e.phase), 0) + 1
    assert counts == {("all_gather", "forward"): 4, ("reduce_scatter", "forward"): 4,
                      ("all_gather", "backward"): 4, ("reduce_scatter", "backward"): 4}


def test_failing_rank_is_named_and_others_do_not_hang() -> None:
    """When rank 1 raises, rank 0's pending all_reduce aborts and the error names rank 1."""
    def run(rank: int) -> torch.Tensor:
        if rank == 1:
            time.sleep(0.05)
            raise RuntimeError("boom on purpose")
        return C.all_reduce(torch.ones(2), "default")

    start = time.monotonic()
    with pytest.raises(TPCompileError, match="simulated rank 1 failed: RuntimeError: boom"):
        simulate_ranks(2, run, timeout=60)
    assert time.monotonic() - start < 5


def test_timeout_names_op_and_rank() -> None:
    """A collective left waiting past the timeout raises TPCompileError naming op and rank."""
    def run(rank: int) -> None:
        if rank == 1:
            time.sleep(1.0)
        C.all_gather(torch.ones(2), 0, "default")

    start = time.monotonic()
    with pytest.raises(TPCompileError, match=r"tpcompile.all_gather on rank 0 .* more than 0.2 s"):
        simulate_ranks(2, run, timeout=0.2)
    assert time.monotonic() - start < 5


def test_rank_that_returns_early_is_reported() -> None:
    """A rank waiting for a rank that already returned fails at once instead of timing out."""
    def run(rank: int) -> None:
        if rank == 0:
            C.all_reduce(torch.ones(2), "default")

    start = time.monotonic()
    with pytest.raises(TPCompileError, match=r"ranks \[1\] returned without calling it"):
        simulate_ranks(2, run, timeout=60)
    assert time.monotonic() - start < 5


def test_mismatched_collectives_are_reported() -> None:
    """Ranks issuing different collectives at the same step raise an error listing both calls."""
    def run(rank: int) -> torch.Tensor:
        if rank == 0:
            return C.all_reduce(torch.ones(4), "default")
        return C.all_gather(torch.ones(4), 0, "default")

    with pytest.raises(TPCompileError, match="differs across ranks.*rank 0: all_reduce.*"
                                             "rank 1: all_gather"):
        simulate_ranks(2, run)


def test_collective_sequence_of_many_steps() -> None:
    """Fifty consecutive all_reduces on 4 ranks each give the rank sum 0+1+2+3."""
    def run(rank: int) -> list[float]:
        return [C.all_reduce(torch.tensor([float(rank + i)]), "default").item()
                for i in range(50)]

    for out in simulate_ranks(4, run):
        assert out == [6.0 + 4 * i for i in range(50)]


def test_simulated_ranks_inherit_the_callers_grad_mode() -> None:
    """Under torch.no_grad() in the caller, the ranks' results carry no autograd graph."""
    import tpcompile
    from tpcompile.models import build

    sm = tpcompile.shard(build("mlp"), 2)
    x = torch.randn(3, 64)
    with torch.no_grad():
        outs = tpcompile.simulate(sm, x)
    assert all(not o.requires_grad for o in outs)
    assert all(o.requires_grad for o in tpcompile.simulate(sm, x))
