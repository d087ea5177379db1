"""The in-place reduction pass: only a dead temporary is summed in place, and numerics do not change."""
from __future__ import annotations

import warnings
from typing import Callable

import pytest
import torch
from torch import fx, nn

import tpcompile
from tpcompile.models import build
from tpcompile.ops import collectives
from tpcompile.ops.schedule import graph_schedule
from tpcompile.passes.comm_inplace import inplace_pass
from tpcompile.passes.comm_options import DEFAULT_COMM, comm_options

aten = torch.ops.aten
AR = torch.ops.tpcompile.all_reduce
WS = 2


def _module(body: Callable[[fx.Graph, fx.Node, fx.Node], fx.Node]) -> fx.GraphModule:
    """A GraphModule with input x (4, 6) and parameter w (6, 6); body builds the rest from (graph, x, w)."""
    root = nn.Module()
    root.w = nn.Parameter(torch.randn(6, 6, generator=torch.Generator().manual_seed(1)))
    g = fx.Graph()
    x = g.placeholder("x")
    w = g.get_attr("w")
    g.output(body(g, x, w))
    return fx.GraphModule(root, g)


def _mm_reduced(g: fx.Graph, x: fx.Node, w: fx.Node) -> fx.Node:
    return g.call_function(AR.default, (g.call_function(aten.mm.default, (x, w)), "default"))


def _other_user(g: fx.Graph, x: fx.Node, w: fx.Node) -> fx.Node:
    y = g.call_function(aten.mm.default, (x, w))
    return g.call_function(aten.add.Tensor, (g.call_function(AR.default, (y, "default")), y))


def _saved_for_backward(g: fx.Graph, x: fx.Node, w: fx.Node) -> fx.Node:
    y = g.call_function(aten.tanh.default, (g.call_function(aten.mm.default, (x, w)),))
    return g.call_function(AR.default, (y, "default"))


def _graph_input(g: fx.Graph, x: fx.Node, w: fx.Node) -> fx.Node:
    s = g.call_function(AR.default, (x, "default"))
    return g.call_function(aten.mm.default, (s, w))


def _parameter(g: fx.Graph, x: fx.Node, w: fx.Node) -> fx.Node:
    return g.call_function(aten.mm.default, (x, g.call_function(AR.default, (w, "default"))))


def _view(g: fx.Graph, x: fx.Node, w: fx.Node) -> fx.Node:
    y = g.call_function(aten.view.default, (g.call_function(aten.mm.default, (x, w)), [24]))
    return g.call_function(AR.default, (y, "default"))


def _reduces(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (AR.default, AR.inplace)]


def _force_inplace(gm: fx.GraphModule) -> fx.GraphModule:
    """What an unchecked pass would emit: every all_reduce in place."""
    for n in _reduces(gm):
        n.target = AR.inplace
    gm.recompile()
    return gm


def _run(gm: fx.GraphModule) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per rank: output, x after the call, x's gradient, w's gradient (rank r's x differs by rank)."""
    def one(rank: int) -> tuple:
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 + rank), requires_grad=True)
        x_in = x * 1.0  # a non-leaf the graph may not overwrite
        before = x_in.detach().clone()
        out = gm(x_in)
        gx, gw = torch.autograd.grad(out.sum(), [x, gm.w])  # gm (and w) is shared by the rank threads
        return out.detach(), (x_in.detach() - before).abs().max(), gx, gw
    return tpcompile.simulate_ranks(WS, one)


def test_dead_temporary_sums_in_place_with_equal_values_and_grads() -> None:
    """mm's output read only by the all_reduce becomes all_reduce.inplace; outputs and grads are unchanged."""
    functional = _run(_module(_mm_reduced))
    gm = inplace_pass(_module(_mm_reduced))
    (node,) = _reduces(gm)
    assert node.target is AR.inplace and node.meta["tp_inplace"] is True
    for (out, _, gx, gw), (ref, _, rgx, rgw) in zip(_run(gm), functional):
        assert torch.equal(out, ref) and torch.equal(gx, rgx) and torch.equal(gw, rgw)
    assert torch.equal(functional[0][0], functional[1][0])  # really summed: both ranks agree


@pytest.mark.parametrize("body, reason", [
    (_other_user, "also read by add"),
    (_saved_for_backward, "saved for backward by aten.tanh.default"),
    (_graph_input, "is a graph input"),
    (_parameter, "parameter or buffer w"),
    (_view, "may be a view"),
])
def test_unsafe_inputs_keep_the_functional_all_reduce(body: Callable, reason: str) -> None:
    """Another reader, a producer that saves its result, a graph input, a parameter or a view: not in place."""
    gm = inplace_pass(_module(body))
    (node,) = _reduces(gm)
    assert node.target is AR.default
    assert reason in node.meta["tp_inplace"]


def test_other_user_would_read_the_sum_if_forced_in_place() -> None:
    """With a second reader, summing in place changes the result: the pass's refusal is what keeps it right."""
    functional = _run(inplace_pass(_module(_other_user)))
    forced = _run(_force_inplace(_module(_other_user)))
    assert not torch.allclose(forced[0][0], functional[0][0])


def test_saved_result_would_break_backward_if_forced_in_place() -> None:
    """tanh saves its output for backward: forced in place, autograd refuses; the pass keeps it functional."""
    assert all(torch.isfinite(r[3]).all() for r in _run(inplace_pass(_module(_saved_for_backward))))
    with pytest.raises(Exception, match="modified by an inplace operation"):
        _run(_force_inplace(_module(_saved_for_backward)))


def test_graph_input_is_left_intact() -> None:
    """An all_reduce of the caller's tensor stays functional, so the caller's x is unchanged; forced, it would not be."""
    assert all(float(r[1]) == 0.0 for r in _run(inplace_pass(_module(_graph_input))))
    with torch.no_grad():  # in place on a leaf that requires grad is refused anyway; without grad it writes
        gm = _force_inplace(_module(_graph_input))

        def one(rank: int) -> float:
            x = torch.full((4, 6), float(rank + 1))
            gm(x)
            return float((x - (rank + 1)).abs().max())
        assert max(tpcompile.simulate_ranks(WS, one)) > 0


def _shard(name: str, comm: object, **kw: object) -> tpcompile.ShardedModel:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tpcompile.TPCompileWarning)
        model = build(name).train()
        return tpcompile.shard(model, WS, example_inputs=model.example_inputs(), comm=comm, **kw)


def _train(sm: tpcompile.ShardedModel, x: torch.Tensor) -> tuple[list, list]:
    """Per rank: logits and every parameter's gradient; and the collectives executed."""
    def one(rank: int) -> tuple:
        gm = sm.rank(rank)
        gm.zero_grad(set_to_none=True)
        out = gm(x)
        out.float().pow(2).mean().backward()
        return out.detach(), {n: p.grad.clone() for n, p in gm.named_parameters() if p.grad is not None}
    with collectives.record() as events:
        res = tpcompile.simulate_ranks(WS, one)
    return res, sorted((e.op, e.phase, e.rank, e.shape) for e in events)


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_row_split_reductions_run_in_place_with_unchanged_numerics(name: str) -> None:
    """comm=True: every row split's all_reduce is in place; same schedule, collectives, outputs and grads."""
    plain, fused = _shard(name, False), _shard(name, tpcompile.CommOptions(bucket_bytes=0))
    gm = fused.rank(0)
    reduces = _reduces(gm)
    assert reduces and all(n.target is AR.inplace for n in reduces if n.args[0].target is not aten.masked_fill.Scalar)
    assert sum(n.target is AR.inplace for n in reduces) >= 2
    assert [c for c, _ in graph_schedule(gm)] == [c for c, _ in graph_schedule(plain.rank(0))]
    x = build(name).example_inputs()[0]
    (ref, ref_events), (got, got_events) = _train(plain, x), _train(fused, x)
    assert got_events == ref_events
    for (out, grads), (rout, rgrads) in zip(got, ref):
        assert torch.equal(out, rout)
        assert grads.keys() == rgrads.keys()
        assert all(torch.equal(grads[k], rgrads[k]) for k in grads)


def test_comm_option_is_checked() -> None:
    """comm= takes True, False, None or CommOptions; anything else names the way out."""
    with pytest.raises(tpcompile.TPCompileError, match="CommOptions"):
        _shard("mlp", "yes")
    with pytest.raises(tpcompile.TPCompileError, match="bucket_bytes"):
        tpcompile.CommOptions(bucket_bytes=-1)


def test_default_runs_the_proven_passes_and_false_runs_none() -> None:
    """comm=None means CommOptions() (as True); comm=False leaves every all_reduce functional; the default ranks
    equal the model."""
    assert comm_options(None) == comm_options(True) == tpcompile.CommOptions() == DEFAULT_COMM
    assert comm_options(False) is None
    default, off = _shard("gpt", None), _shard("gpt", False)
    assert default.comm == DEFAULT_COMM and off.comm is None
    assert any(n.target is AR.inplace for n in _reduces(default.rank(0)))
    assert _reduces(off.rank(0)) and all(n.target is AR.default for n in _reduces(off.rank(0)))
    model = build("gpt").train()
    x = model.example_inputs()[0]
    with torch.no_grad():
        want = model(x)
        for out in tpcompile.simulate(default, x):
            torch.testing.assert_close(out, want, atol=1e-5, rtol=0)
