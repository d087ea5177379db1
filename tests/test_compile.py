"""Rank graphs stay traceable and compilable by torch.compile, collectives included.

torch.compile runs fine on a simulator thread (dynamo does not require the main thread),
so the world-size-1 check uses simulate_ranks; the world-size-2 check compiles each rank
in its own real gloo process, as a torchrun job would.
"""
from __future__ import annotations

import warnings
from collections import Counter
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import tpcompile
from tpcompile.models import build
from tpcompile.ops import collectives
from tpcompile.runtime import launch

TOL = 1e-5
N_LAYER = 2  # the bundled GPT's blocks
# Collectives in the bundled GPT's rank graph: one forward all-reduce per attention and MLP
# output plus one for the vocabulary-split embedding; a grad_all_reduce before each of the
# 5 column-split consumers of a replicated input; one gather of the logits.
RANK_GRAPH_OPS = {"all_reduce": 2 * N_LAYER + 1, "grad_all_reduce": 2 * N_LAYER + 1,
                  "all_gather_replicated": 1}


def _tp_ops(gm: torch.fx.GraphModule) -> dict[str, int]:
    """How many times each torch.ops.tpcompile collective is called in gm's graph."""
    return dict(Counter(n.target._opname for n in gm.graph.nodes
                        if n.op == "call_function" and getattr(n.target, "namespace", None) == "tpcompile"))


class RecordingBackend:
    """A torch.compile backend that notes the tpcompile ops in every graph it is handed.

    Dynamo's graph goes to aot_autograd with compilers that run the graphs eagerly (what
    "aot_eager" does), noting the ops of the forward and backward graphs aot_autograd makes.
    """

    def __init__(self) -> None:
        """Start with no graphs seen."""
        self.graphs: dict[str, list[dict[str, int]]] = {"dynamo": [], "forward": [], "backward": []}
        self._aot = aot_autograd(fw_compiler=self._compiler("forward"),
                                 bw_compiler=self._compiler("backward"))

    def _compiler(self, kind: str) -> Callable:
        def compile_graph(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
            self.graphs[kind].append(_tp_ops(gm))
            return make_boxed_func(gm.forward)
        return compile_graph

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        """Record dynamo's graph, then compile it the aot_eager way."""
        self.graphs["dynamo"].append(_tp_ops(gm))
        return self._aot(gm, example_inputs)


def _shard(model: torch.nn.Module, ws: int) -> tpcompile.ShardedModel:
    """shard() the bundled model on its example inputs, plan warnings silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tpcompile.TPCompileWarning)
        return tpcompile.shard(model, ws, example_inputs=model.example_inputs())


def _ids(shape: tuple[int, int], seed: int) -> torch.Tensor:
    """Token ids < 256, the same in every process."""
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed))


def _next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of predicting token t+1 from positions <= t."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


@pytest.fixture
def fresh_dynamo() -> Any:
    """Reset dynamo's caches around a test so compiled code never leaks between tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_aot_eager_world_size_1_matches_uncompiled(fresh_dynamo: Any) -> None:
    """fullgraph aot_eager of gpt's rank 0 at ws 1 equals the uncompiled rank and the model."""
    model = build("gpt")
    sm = _shard(model, 1)
    gm = sm.rank(0)
    assert _tp_ops(gm) == RANK_GRAPH_OPS
    inputs = [model.example_inputs()[0], _ids((3, 37), seed=7)]
    recorder = RecordingBackend()

    def run(rank: int) -> list[tuple[float, float, float, tuple]]:
        compiled = torch.compile(gm, backend="aot_eager", fullgraph=True)
        recorded = torch.compile(gm, backend=recorder, fullgraph=True)
        out = []
        with torch.no_grad():
            for x in inputs:
                got, plain, ref = compiled(x), gm(x), model(x)
                out.append((float((got - plain).abs().max()), float((got - ref).abs().max()),
                            float((recorded(x) - got).abs().max()), tuple(got.shape)))
        return out

    (results,) = tpcompile.simulate_ranks(1, run)
    for (vs_plain, vs_model, vs_recorded, shape), x in zip(results, inputs):
        assert shape == (*x.shape, 256)
        assert vs_recorded <= TOL, f"{shape}: recording backend vs aot_eager {vs_recorded:.3g}"
        assert vs_plain <= TOL, f"{shape}: compiled vs uncompiled rank {vs_plain:.3g}"
        assert vs_model <= TOL, f"{shape}: compiled rank vs model {vs_model:.3g}"
    # dynamo hands the backend the whole graph with every collective still in it
    assert len(recorder.graphs["dynamo"]) >= 1
    for ops in recorder.graphs["dynamo"]:
        assert ops == RANK_GRAPH_OPS


def _compiled_rank_on_gloo(rank: int) -> dict:
    """Compile this rank of gpt at ws 2, run forward+backward, compare with uncompiled and model."""
    torch.manual_seed(0)
    model = build("gpt").train()
    sm = _shard(model, 2)
    gm = sm.rank(rank)
    ids = _ids((4, 16), seed=1)

    loss = _next_token_loss(gm(ids), ids)
    loss.backward()
    plain_grads = {n: p.grad.clone() for n, p in gm.named_parameters()}
    gm.zero_grad(set_to_none=True)

    recorder = RecordingBackend()
    compiled = torch.compile(gm, backend=recorder, fullgraph=True)
    with collectives.record() as events:
        logits = compiled(ids)
        compiled_loss = _next_token_loss(logits, ids)
        compiled_loss.backward()
    grads = {n: p.grad.clone() for n, p in gm.named_parameters()}
    ref = model(ids)

    with torch.no_grad():  # a new batch and length: recompiles, still with the collectives
        x2 = _ids((3, 37), seed=2)
        new_shape_diff = float((compiled(x2) - model(x2)).abs().max())

    return {
        "rank_graph_ops": _tp_ops(gm),
        "graphs": recorder.graphs,
        "events": dict(Counter((e.op, e.phase) for e in events if e.rank == rank)),
        "forward_diff": float((logits.detach() - ref.detach()).abs().max()),
        "loss": (compiled_loss.item(), loss.item()),
        "grad_diffs": {n: float((grads[n] - g).abs().max()) for n, g in plain_grads.items()},
        "grad_shapes": {n: (tuple(grads[n].shape), tuple(g.shape)) for n, g in plain_grads.items()},
        "new_shape_diff": new_shape_diff,
    }


@pytest.mark.gloo
def test_compiled_rank_on_gloo_forward_and_backward() -> None:
    """At ws 2 under gloo a compiled rank equals the model forward and the uncompiled rank's grads."""
    results = launch(2, _compiled_rank_on_gloo, timeout=180)
    assert len(results) == 2
    for r, res in enumerate(results):
        assert res["rank_graph_ops"] == RANK_GRAPH_OPS
        assert res["forward_diff"] <= TOL, f"rank {r}: forward diff {res['forward_diff']:.3g}"
        assert res["new_shape_diff"] <= TOL, f"rank {r}: (3, 37) diff {res['new_shape_diff']:.3g}"
        loss, plain_loss = res["loss"]
        assert abs(loss - plain_loss) <= TOL * abs(plain_loss)
        assert len(res["grad_diffs"]) > 0
        for name, diff in res["grad_diffs"].items():
            got, want = res["grad_shapes"][name]
            assert got == want, f"rank {r} {name}: {got} vs {want}"
            assert diff <= TOL, f"rank {r} {name}: compiled vs uncompiled grad diff {diff:.3g}"

        graphs = res["graphs"]
        # dynamo keeps every collective; one graph for the training batch, one for (3, 37)
        assert len(graphs["dynamo"]) == 2
        assert all(ops == RANK_GRAPH_OPS for ops in graphs["dynamo"])
        # aot_autograd: grad_all_reduce is an alias in forward and an all_reduce in backward
        fwd = {"all_reduce": 2 * N_LAYER + 1, "all_gather_replicated": 1}
        assert graphs["forward"] == [fwd, fwd]  # training graph, then the no_grad graph
        assert graphs["backward"] == [{"all_reduce": 2 * N_LAYER + 1}]
        # and the compiled code really ran them on gloo, forward and backward
        assert res["events"] == {("all_reduce", "forward"): 2 * N_LAYER + 1,
                                 ("all_gather_replicated", "forward"): 1,
                                 ("all_reduce", "backward"): 2 * N_LAYER + 1}
