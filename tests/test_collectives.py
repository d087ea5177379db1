"""torch.ops.tpcompile collectives: forward values, Megatron backward rules, tracing, records."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from tpcompile.errors import TPCompileError
from tpcompile.ops import collectives as C
from tpcompile.runtime.simulator import simulate_ranks

DIM_OPS = ("all_gather", "reduce_scatter", "all_gather_replicated", "scatter")


def _x(rank: int) -> torch.Tensor:
    """This rank's input: (4, 8) values that differ per rank."""
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 + rank))


def _call(name: str, x: torch.Tensor, dim: int) -> torch.Tensor:
    """Call op name through torch.ops with its exact schema."""
    op = getattr(torch.ops.tpcompile, name).default
    return op(x, "default") if name not in DIM_OPS else op(x, dim, "default")


def _ordered_sum(ts: list[torch.Tensor]) -> torch.Tensor:
    """Sum tensors in list order, as the simulator does."""
    out = ts[0].clone()
    for t in ts[1:]:
        out = out + t
    return out


def _expected(name: str, xs: list[torch.Tensor], gs: list[torch.Tensor], dim: int,
              rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Hand-computed (forward output, input gradient) of op name on rank."""
    ws = len(xs)
    own = lambda t: t.chunk(ws, dim)[rank]  # noqa: E731
    rules = {
        "all_reduce": lambda: (_ordered_sum(xs), gs[rank]),
        "all_gather": lambda: (torch.cat(xs, dim), _ordered_sum([own(g) for g in gs])),
        "reduce_scatter": lambda: (_ordered_sum([own(x) for x in xs]), torch.cat(gs, dim)),
        "all_gather_replicated": lambda: (torch.cat(xs, dim), own(gs[rank])),
        "grad_all_reduce": lambda: (xs[rank], _ordered_sum(gs)),
        "scatter": lambda: (own(xs[rank]), torch.cat(gs, dim)),
    }
    return rules[name]()


@pytest.fixture
def tracing_world():
    """Register world size 4 for the 'default' group while tracing on the main thread."""
    C.register_group("default", 4)
    yield 4
    C.unregister_group("default")


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("name", C.COLLECTIVE_OPS)
@pytest.mark.parametrize("dim", [1, -2])
def test_forward_and_backward_match_reference(name: str, world_size: int, dim: int) -> None:
    """Every op's output and input gradient equal the hand-computed Megatron pair on every rank."""
    xs = [_x(r) for r in range(world_size)]

    def run(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = xs[rank].clone().requires_grad_()
        y = _call(name, x, dim)
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(7 + rank))
        (gx,) = torch.autograd.grad(y, x, g)
        return y.detach(), g, gx

    out = simulate_ranks(world_size, run)
    gs = [o[1] for o in out]
    for rank, (y, _, gx) in enumerate(out):
        want_y, want_gx = _expected(name, xs, gs, dim % 2, rank)
        torch.testing.assert_close(y, want_y, rtol=0, atol=0)
        torch.testing.assert_close(gx, want_gx, rtol=0, atol=0)


def test_all_reduce_is_bitwise_identical_across_ranks() -> None:
    """all_reduce of rank-different float32 values gives the very same bits on all four ranks."""
    outs = simulate_ranks(4, lambda r: C.all_reduce(_x(r) * 1e3 + 1e-3, "default"))
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    torch.testing.assert_close(outs[0], sum(_x(r) * 1e3 + 1e-3 for r in range(4)))


def test_ops_are_registered_with_exact_schemas() -> None:
    """Each op exists as torch.ops.tpcompile.<name>.default with the documented schema."""
    want = {
        "all_reduce": "tpcompile::all_reduce(Tensor x, str group) -> Tensor",
        "all_gather": "tpcompile::all_gather(Tensor x, int dim, str group, *, SymInt? size=None) -> Tensor",
        "reduce_scatter": "tpcompile::reduce_scatter(Tensor x, int dim, str group) -> Tensor",
        "all_gather_replicated":
            "tpcompile::all_gather_replicated(Tensor x, int dim, str group, *, SymInt? size=None) -> Tensor",
        "grad_all_reduce": "tpcompile::grad_all_reduce(Tensor(a) x, str group) -> Tensor(a)",
        "scatter": "tpcompile::scatter(Tensor x, int dim, str group) -> Tensor",
    }
    assert set(C.COLLECTIVE_OPS) == set(want)
    assert C.FORWARD_COLLECTIVES == {"all_reduce", "all_gather", "reduce_scatter",
                                       "all_gather_replicated"}
    for name, schema in want.items():
        assert str(getattr(torch.ops.tpcompile, name).default._schema) == schema


def test_symbolic_trace_records_call_function_nodes() -> None:
    """torch.fx.symbolic_trace keeps each op as a call_function node that prints and runs."""
    def f(x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.tpcompile.grad_all_reduce.default(x, "default")
        y = torch.ops.tpcompile.scatter.default(y, 1, "default")
        return torch.ops.tpcompile.all_gather.default(y * 2, 1, "default")

    gm = torch.fx.symbolic_trace(f)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.tpcompile.scatter.default in targets
    assert "torch.ops.tpcompile.grad_all_reduce.default" in gm.code
    outs = simulate_ranks(2, lambda r: gm(_x(0)))
    for o in outs:
        torch.testing.assert_close(o, _x(0) * 2)


def test_make_fx_fake_shapes(tracing_world: int) -> None:
    """make_fx with fake tensors keeps the ops and infers world-size-4 shapes without a backend."""
    def f(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (C.all_reduce(x, "default"), C.all_gather(x, 1, "default"),
                C.reduce_scatter(x, 0, "default"), C.all_gather_replicated(x, 0, "default"),
                C.grad_all_reduce(x, "default"), C.scatter(x, 1, "default"))

    gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 8))
    shapes = {n.target.__name__.split(".")[0]: tuple(n.meta["val"].shape)
              for n in gm.graph.nodes if n.op == "call_function"}
    assert shapes == {"all_reduce": (4, 8), "all_gather": (4, 32), "reduce_scatter": (1, 8),
                      "all_gather_replicated": (16, 8), "grad_all_reduce": (4, 8),
                      "scatter": (4, 2)}


def test_make_fx_symbolic_shapes(tracing_world: int) -> None:
    """With symbolic sizes the fake kernels give s*4 for a gather and s//4 for a scatter."""
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return C.all_gather(x, 0, "default"), C.scatter(x, 0, "default")

    gm = make_fx(f, tracing_mode="symbolic")(torch.randn(8, 3))
    gathered, scattered = [n.meta["val"] for n in gm.graph.nodes if n.op == "call_function"
                           and "tpcompile" in str(n.target)]
    assert isinstance(gathered.shape[0], torch.SymInt)
    assert gathered.shape[0].node.hint == 32 and scattered.shape[0].node.hint == 2


def test_make_fx_inside_simulated_rank_uses_simulated_world() -> None:
    """Fake shapes inside a simulated rank come from the simulator's world size (2)."""
    lock = threading.Lock()

    def run(rank: int) -> torch.fx.GraphModule:
        # make_fx patches global state while tracing, so ranks must trace one at a time.
        with lock:
            return make_fx(lambda x: C.all_gather(x, 0, "default"),
                           tracing_mode="fake")(torch.randn(3, 5))

    gms = simulate_ranks(2, run)
    vals = [n.meta["val"].shape for n in gms[1].graph.nodes if n.op == "call_function"]
    assert vals == [torch.Size([6, 5])]


def test_grad_all_reduce_forward_does_not_copy() -> None:
    """grad_all_reduce returns a view sharing x's storage, and its gradient is the rank sum."""
    def run(rank: int) -> tuple[bool, torch.Tensor]:
        x = torch.ones(3, requires_grad=True)
        y = C.grad_all_reduce(x, "default")
        same = y.data_ptr() == x.data_ptr() and y._base is x
        y.backward(torch.full((3,), float(rank + 1)))
        return same, x.grad

    for same, grad in simulate_ranks(2, run):
        assert same
        torch.testing.assert_close(grad, torch.full((3,), 3.0))


def test_grad_all_reduce_view_rejects_in_place_while_requiring_grad() -> None:
    """Like any view made in a custom autograd function, the output may not be modified in place."""
    def run(rank: int) -> None:
        y = C.grad_all_reduce(torch.ones(2, requires_grad=True), "default")
        with pytest.raises(RuntimeError, match="view and is being modified inplace"):
            y.mul_(2)

    simulate_ranks(1, run)
    plain = torch.ones(2)
    simulate_ranks(1, lambda r: C.grad_all_reduce(plain, "default").mul_(2))
    torch.testing.assert_close(plain, torch.full((2,), 2.0))


def test_grad_all_reduce_under_aot_autograd_keeps_backward_all_reduce() -> None:
    """aot_autograd functionalizes grad_all_reduce and still runs its backward all-reduce."""
    from functorch.compile import aot_function, nop

    def run(rank: int) -> torch.Tensor:
        f = aot_function(lambda x: C.grad_all_reduce(x, "default") * 3, fw_compiler=nop)
        x = torch.ones(4, requires_grad=True)
        f(x).sum().backward()
        return x.grad

    with C.record() as events:
        (grad,) = simulate_ranks(1, run)
    torch.testing.assert_close(grad, torch.full((4,), 3.0))
    assert [(e.op, e.phase) for e in events] == [("all_reduce", "backward")]


@pytest.mark.parametrize("name, expected", [
    ("all_reduce", [("all_reduce", "forward")]),
    ("all_gather", [("all_gather", "forward"), ("reduce_scatter", "backward")]),
    ("reduce_scatter", [("reduce_scatter", "forward"), ("all_gather", "backward")]),
    ("all_gather_replicated", [("all_gather_replicated", "forward")]),
    ("grad_all_reduce", [("all_reduce", "backward")]),
    ("scatter", [("all_gather", "backward")]),
])
def test_record_counts_forward_and_backward_communication(name: str, expected: list) -> None:
    """record() sees one event per rank for each collective that communicates, tagged by phase."""
    def run(rank: int) -> None:
        x = _x(rank).requires_grad_()
        _call(name, x, 1).sum().backward()

    with C.record() as events:
        simulate_ranks(2, run)
    seen = sorted((e.op, e.phase, e.rank) for e in events)
    assert seen == sorted((op, phase, r) for op, phase in expected for r in range(2))
    first = [e for e in events if e.phase == "forward"]
    for e in first:
        assert e.shape == (4, 8) and e.nbytes == 4 * 8 * 4


def test_no_backend_raises() -> None:
    """Outside a simulator and without torch.distributed, a collective explains how to run it."""
    with pytest.raises(TPCompileError, match="torchrun.*simulate"):
        C.all_reduce(torch.ones(2), "default")
    with pytest.raises(TPCompileError):
        C.rank_of("default")


def test_world_size_and_rank_helpers_in_simulator() -> None:
    """world_size_of and rank_of report the simulated world on every rank."""
    got = simulate_ranks(4, lambda r: (C.world_size_of("default"), C.rank_of("tp")))
    assert got == [(4, 0), (4, 1), (4, 2), (4, 3)]


@pytest.mark.parametrize("world_size,size", [(3, 7), (4, 3), (2, 6)])
@pytest.mark.parametrize("name", ["reduce_scatter", "scatter", "all_gather", "all_gather_replicated"])
def test_shares_of_any_size(name: str, world_size: int, size: int) -> None:
    """A dim the world size does not divide splits in torch.tensor_split's shares (the first size % ws ranks one
    more, none for ranks past the size); gathers given the whole size put them back; each backward is the
    conjugate's."""
    full = [torch.randn(2, size, 3, generator=torch.Generator().manual_seed(r)) for r in range(world_size)]
    grads = [torch.randn(2, size, 3, generator=torch.Generator().manual_seed(50 + r)) for r in range(world_size)]
    part = lambda t, r: torch.tensor_split(t, world_size, 1)[r]  # noqa: E731

    def run(rank: int) -> tuple:
        gather = name.startswith("all_gather")
        x = (part(full[rank], rank) if gather else full[rank]).clone().requires_grad_()
        op = getattr(torch.ops.tpcompile, name).default
        y = op(x, 1, "default", size=size) if gather else op(x, 1, "default")
        g = grads[rank] if gather else part(grads[rank], rank)
        y.backward(g)
        return y.detach(), x.grad

    for rank, (y, gx) in enumerate(simulate_ranks(world_size, run)):
        mine = lambda ts: part(_ordered_sum(ts), rank)  # noqa: E731
        want = {"reduce_scatter": (mine(full), torch.cat([part(g, r) for r, g in enumerate(grads)], 1)),
                "scatter": (part(full[rank], rank), torch.cat([part(g, r) for r, g in enumerate(grads)], 1)),
                "all_gather": (torch.cat([part(x, r) for r, x in enumerate(full)], 1), mine(grads)),
                "all_gather_replicated": (torch.cat([part(x, r) for r, x in enumerate(full)], 1),
                                          part(grads[rank], rank))}[name]
        torch.testing.assert_close(y, want[0])
        torch.testing.assert_close(gx, want[1])


def test_wrong_share_and_bad_dim_raise() -> None:
    """A gather on a rank holding other than its share of the given size (ranks fed different lengths), or of a
    dim out of range, raises TPCompileError before communicating."""
    def run(rank: int) -> None:
        if rank == 1:
            with pytest.raises(TPCompileError, match="rank 1 holds 3 of the 5 entries of dim 1 split over 2 ranks, "
                                                     "not its share of 2: every rank must run on the same inputs"):
                C.all_gather(torch.ones(3, 3), 1, "default", size=5)
        with pytest.raises(TPCompileError, match="dim 2 is out of range"):
            C.all_gather(torch.ones(3, 5), 2, "default")

    assert simulate_ranks(2, run) == [None, None]
    with pytest.raises(TPCompileError, match="int >= 1"):
        C.register_group("tp", 0)
