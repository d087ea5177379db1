"""Async all-reduces: start right after the input, wait right before the first reader; input-gradient
all-reduces overlapped with weight gradients; numerics unchanged."""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

import tpcompile
from tpcompile.ops import collectives
from tpcompile.ops.schedule import graph_schedule
from tpcompile.passes.comm_async import META_KEY
from tpcompile.passes.comm_linear_grads import META_KEY as LINEARS_KEY

START = torch.ops.tpcompile.all_reduce.start
WAIT = torch.ops.tpcompile_async.wait.default
LINEARS = torch.ops.tpcompile.linears_grad_all_reduce.default


class ParallelBlocks(nn.Module):
    """Blocks whose two branches (two MLPs here) read the same normed input and are summed at the end."""

    def __init__(self, d: int = 32, n: int = 2) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(n))
        self.a = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(n))
        self.b = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norm, a, b in zip(self.norms, self.a, self.b):
            h = norm(x)
            x = x + a(h) + b(h)
        return x


def _shard(comm: object) -> tuple[tpcompile.ShardedModel, torch.Tensor]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = ParallelBlocks().train()
    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tpcompile.TPCompileWarning)
        return tpcompile.shard(model, 2, example_inputs=(x,), comm=comm), x


def _train(sm: tpcompile.ShardedModel, x: torch.Tensor) -> tuple[list, list]:
    def one(rank: int) -> tuple:
        gm = sm.rank(rank)
        gm.zero_grad(set_to_none=True)
        xr = x.clone().requires_grad_(True)
        out = gm(xr)
        F.mse_loss(out, torch.ones_like(out)).backward()
        return out.detach(), xr.grad, {n: p.grad.clone() for n, p in gm.named_parameters()}
    with collectives.record() as events:
        res = tpcompile.simulate_ranks(2, one)
    return res, sorted((e.op, e.phase, e.rank, e.shape) for e in events)


def _same_training(plain: tpcompile.ShardedModel, fast: tpcompile.ShardedModel, x: torch.Tensor) -> None:
    """The same collectives and outputs; input and parameter gradients equal up to the order of sums (1e-6)."""
    (want, want_events), (got, got_events) = _train(plain, x), _train(fast, x)
    assert got_events == want_events
    for (out, gx, grads), (rout, rgx, rgrads) in zip(got, want):
        assert torch.equal(out, rout) and torch.allclose(gx, rgx, atol=1e-6, rtol=0)
        for k in rgrads:
            assert torch.allclose(grads[k], rgrads[k], atol=1e-6, rtol=0), k


def test_start_follows_its_input_and_wait_precedes_the_first_reader() -> None:
    """Each row split's sum starts right after the matmul and is waited for right before the residual add."""
    sm, _ = _shard(tpcompile.CommOptions(asynchronous=True))
    nodes = list(sm.rank(0).graph.nodes)
    starts = [n for n in nodes if n.target is START]
    assert len(starts) == 4  # two branches per block, two blocks
    for s in starts:
        i = nodes.index(s)
        assert nodes[i - 1] is s.args[0]  # right after the matmul that computes it
        (wait,) = s.users
        assert wait.target is WAIT
        first = min(wait.users, key=nodes.index)
        assert nodes.index(first) == nodes.index(wait) + 1  # right before the first reader
        assert s.meta[META_KEY] == nodes.index(wait) - i - 1
    # the first branch's sum is in flight while the second branch computes its row-split matmul and
    # starts its own sum; the second's is in flight while the first's is added to the residual
    for first, second in ((starts[0], starts[1]), (starts[2], starts[3])):
        (wait,) = first.users
        assert nodes.index(first) < nodes.index(second.args[0]) < nodes.index(second) < nodes.index(wait)
        assert first.meta[META_KEY] >= 3 and second.meta[META_KEY] >= 3


def test_async_schedule_and_numerics_equal_the_synchronous_graph() -> None:
    """Same collectives (the start reads as an all_reduce, the fused linears as the grad_all_reduce they
    replace), same outputs; input and parameter gradients equal up to the order of sums (1e-6)."""
    plain, x = _shard(False)
    fast, _ = _shard(tpcompile.CommOptions(asynchronous=True))
    renamed = {"linears_grad_all_reduce": "grad_all_reduce"}
    assert [renamed.get(c.op, c.op) for c, _ in graph_schedule(fast.rank(0))] == \
        [c.op for c, _ in graph_schedule(plain.rank(0))]
    _same_training(plain, fast, x)


def test_branches_reading_one_input_fuse_their_linears() -> None:
    """Both branches' first linears read grad_all_reduce(ln(x)): one linears_grad_all_reduce per block holds
    them, so in backward the input gradient's all-reduce overlaps the weight gradients."""
    sm, _ = _shard(tpcompile.CommOptions(asynchronous=True))
    nodes = list(sm.rank(0).graph.nodes)
    fused = [n for n in nodes if n.target is LINEARS]
    assert len(fused) == 2 and all(n.meta[LINEARS_KEY] == 2 for n in fused)
    assert not any(n.target is torch.ops.tpcompile.grad_all_reduce.default for n in nodes)
    assert [w.target for w in fused[0].args[0][1:3]] == ["a.0.0.weight", "b.0.0.weight"]
    assert fused[0].args[1] == [1, 1]  # both with a bias


def test_overlapped_input_gradient_is_one_backward_all_reduce() -> None:
    """The fused backward still issues exactly one all-reduce per block for the input gradient."""
    plain, x = _shard(False)
    fast, _ = _shard(tpcompile.CommOptions(asynchronous=True))
    count = lambda events: sum(e[0] == "all_reduce" and e[1] == "backward" for e in events)  # noqa: E731
    assert count(_train(fast, x)[1]) == count(_train(plain, x)[1]) == 2 * 2  # 2 blocks, 2 ranks


def test_fused_linears_under_autocast_match_the_unfused_graph() -> None:
    """Sharded under bf16 autocast: the fused backward computes in the gradients' precision like linear's."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain, x = _shard(False)
        fast, _ = _shard(tpcompile.CommOptions(asynchronous=True))
        assert any(n.target is LINEARS for n in fast.rank(0).graph.nodes)
        (want, _), (got, _) = _train(plain, x), _train(fast, x)
    for (out, gx, grads), (rout, rgx, rgrads) in zip(got, want):
        assert out.dtype == rout.dtype and torch.equal(out, rout)
        assert gx.dtype == rgx.dtype and torch.allclose(gx, rgx, atol=1e-6, rtol=0)
        for k in rgrads:
            assert grads[k].dtype == rgrads[k].dtype
            assert torch.allclose(grads[k], rgrads[k], atol=1e-6, rtol=0), k


class CastAfterSum(nn.Module):
    """An MLP whose row split's sum (no bias) is read by a cast (`.to(float32)`) and a residual-like add:
    export records an `_assert_tensor_metadata` node that reads the sum first and that nothing reads, as
    where a Llama-style norm casts its input to float32."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc2(F.gelu(self.fc1(x)))
        return h + h.to(torch.float32).sin()


def test_a_reader_nothing_reads_is_passed_and_numerics_hold() -> None:
    """A node reading the sum with no readers of its own (an assertion) does not stop the pass: the rank graph
    is built in bounded time, the assertion still comes after the wait, and outputs and gradients equal the
    synchronous graph's."""
    import threading

    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(2))
    shard = {}
    for key, comm in (("plain", False), ("fast", tpcompile.CommOptions(asynchronous=True))):
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tpcompile.TPCompileWarning)
            shard[key] = tpcompile.shard(CastAfterSum().train(), 2, example_inputs=(x,), comm=comm)
    built: list = []
    worker = threading.Thread(target=lambda: built.append(shard["fast"].rank(0)), daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert built, "building the asynchronous rank graph did not finish in 60 s"
    nodes = list(built[0].graph.nodes)
    asserts = [n for n in nodes if n.target is torch.ops.aten._assert_tensor_metadata.default and not n.users]
    (wait,) = [n for n in nodes if n.target is WAIT]
    assert asserts, "the model no longer records an assertion nothing reads; the test needs another model"
    assert all(nodes.index(a) > nodes.index(wait) for a in asserts)
    _same_training(shard["plain"], shard["fast"], x)


def test_the_wait_moves_no_op_that_draws_random_numbers() -> None:
    """Only readers that write nothing and draw no random numbers are moved later: moving a random op past
    another would change which numbers each draws."""
    from torch import fx

    from tpcompile.passes.comm_async import _pure
    aten = torch.ops.aten
    graph = fx.Graph()
    x = graph.placeholder("x")
    cases = {aten.add.Tensor: (x, x), aten.rand_like.default: (x,), aten.bernoulli.p: (x, 0.5),
             aten.add_.Tensor: (x, x), aten._assert_tensor_metadata.default: (x,)}
    moved = {op: _pure(graph.call_function(op, args)) for op, args in cases.items()}
    assert moved == {aten.add.Tensor: True, aten.rand_like.default: False, aten.bernoulli.p: False,
                     aten.add_.Tensor: False, aten._assert_tensor_metadata.default: True}
