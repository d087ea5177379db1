"""Comm lowering: a rank graph whose collectives are _c10d_functional ops compiles with inductor, forward
and backward, equal to the eager rank graph; inductor's graphs hold the functional collectives. The same
gloo processes check the asynchronous all-reduces on real work handles."""
from __future__ import annotations

import time
import warnings
from collections import Counter
from typing import Any

import pytest
import torch

import tpcompile
from tpcompile.models.gpt import GPT, GPTConfig
from tpcompile.passes.comm_lower import META_KEY
from tpcompile.runtime.launch import launch

from test_comm_gloo import seeded_gpt

TOL = 1e-5


def _post_grad_collectives(seen: list) -> Any:
    """An inductor post-grad pass that notes the _c10d_functional ops of every graph inductor compiles."""
    def note(graph: torch.fx.Graph) -> None:
        seen.append(dict(Counter(n.target._opname for n in graph.nodes if n.op == "call_function"
                                 and getattr(n.target, "namespace", None) == "_c10d_functional")))
    return note


def _compiled_rank(rank: int, sequence_parallel: bool) -> dict:
    """Shard a 1-block GPT at ws 2, compile this rank's lowered graph with inductor, run fwd+bwd, compare."""
    import torch._inductor.config as inductor_config
    model, ids = seeded_gpt(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tpcompile.TPCompileWarning)
        eager = tpcompile.shard(model, 2, example_inputs=(ids,), comm=True, sequence_parallel=sequence_parallel)
        lowered = tpcompile.shard(model, 2, example_inputs=(ids,), sequence_parallel=sequence_parallel,
                                  comm=tpcompile.CommOptions(lower_c10d=True))

    def step(gm: torch.nn.Module, call: Any = None) -> tuple:
        out = (gm if call is None else call)(ids)
        out.float().pow(2).mean().backward()
        return out.detach(), {n: p.grad.clone() for n, p in gm.named_parameters() if p.grad is not None}

    ref_out, ref_grads = step(eager.rank(rank))
    gm = lowered.rank(rank)
    lowered_ops = Counter(n.meta[META_KEY] for n in gm.graph.nodes if META_KEY in n.meta)
    left = [n.name for n in gm.graph.nodes if getattr(n.target, "namespace", None) == "tpcompile"]
    eager_lowered = step(gm)
    gm.zero_grad(set_to_none=True)

    seen: list = []
    inductor_config.post_grad_custom_post_pass = _post_grad_collectives(seen)
    inductor_config.fx_graph_cache = False
    torch._dynamo.reset()
    compiled = torch.compile(gm, backend="inductor")
    start = time.perf_counter()
    out, grads = step(gm, compiled)
    first = time.perf_counter() - start
    torch._dynamo.reset()
    with warnings.catch_warnings():  # the asynchronous all-reduces on real gloo work handles, eager
        warnings.simplefilter("ignore", tpcompile.TPCompileWarning)
        overlapped = tpcompile.shard(model, 2, example_inputs=(ids,),
                                     comm=tpcompile.CommOptions(asynchronous=True)).rank(rank)
        synchronous = tpcompile.shard(model, 2, example_inputs=(ids,)).rank(rank)
        lowered_async = tpcompile.shard(model, 2, example_inputs=(ids,),
                                        comm=tpcompile.CommOptions(asynchronous=True, lower_c10d=True)).rank(rank)
    starts = sum(n.target is torch.ops.tpcompile.all_reduce.start for n in overlapped.graph.nodes)
    fused = sum(n.target is torch.ops.tpcompile.linears_grad_all_reduce.default for n in overlapped.graph.nodes)
    (a_out, a_grads), (s_out, s_grads) = step(overlapped), step(synchronous)
    l_out, l_grads = step(lowered_async)  # start, wait and fused linears lowered, run eagerly
    return {
        "async_starts": starts, "fused_linears": fused,
        "async_diff": max([float((a_out - s_out).abs().max())] + [float((a_grads[k] - g).abs().max())
                                                                  for k, g in s_grads.items()]),
        "lowered_async_diff": max([float((l_out - s_out).abs().max())] + [float((l_grads[k] - g).abs().max())
                                                                           for k, g in s_grads.items()]),
        "lowered_async_left": [n.name for n in lowered_async.graph.nodes
                               if getattr(n.target, "namespace", None) in ("tpcompile", "tpcompile_async")],
        "lowered_ops": dict(lowered_ops), "left": left, "inductor_graphs": seen, "compile_s": first,
        "eager_lowered_diff": max([float((eager_lowered[0] - ref_out).abs().max())]
                                  + [float((eager_lowered[1][k] - g).abs().max()) for k, g in ref_grads.items()]),
        "out_diff": float((out - ref_out).abs().max()),
        "grad_diffs": {k: float((grads[k] - g).abs().max()) for k, g in ref_grads.items()},
        "grad_names": (sorted(grads), sorted(ref_grads)),
    }


@pytest.mark.slow  # two inductor compiles of forward and backward: about two minutes on 2 CPU cores
@pytest.mark.gloo
def test_inductor_compiles_lowered_rank_forward_and_backward() -> None:
    """ws 2 on gloo, sequence parallel (gathers, reduce-scatters, a gradient bucket): inductor equals eager."""
    results = launch(2, _compiled_rank, True, timeout=600)
    print("compile + first step, s:", [round(res["compile_s"], 1) for res in results])
    for r, res in enumerate(results):
        assert res["left"] == [], f"rank {r}: tpcompile ops left after lowering: {res['left']}"
        assert res["lowered_ops"]["tpcompile.reduce_scatter"] >= 2 and res["lowered_ops"]["tpcompile.all_gather"] >= 2
        assert res["lowered_ops"]["tpcompile.grad_bucket_all_reduce"] == 1
        assert res["eager_lowered_diff"] <= TOL, f"rank {r}: lowered eager vs tpcompile ops {res['eager_lowered_diff']}"
        assert res["out_diff"] <= TOL, f"rank {r}: compiled forward diff {res['out_diff']:.3g}"
        names, ref_names = res["grad_names"]
        assert names == ref_names and len(names) > 5
        worst = max(res["grad_diffs"].items(), key=lambda kv: kv[1])
        assert worst[1] <= TOL, f"rank {r}: compiled grad diff {worst}"
        # inductor compiled a forward and a backward graph, both with functional collectives in them
        graphs = res["inductor_graphs"]
        assert len(graphs) >= 2
        assert graphs[0].get("reduce_scatter_tensor", 0) >= 2 and graphs[0].get("all_gather_into_tensor", 0) >= 2
        assert any(g.get("all_reduce", 0) >= 1 for g in graphs[1:])  # the bucket's one all-reduce, in backward
        assert all(g.get("wait_tensor", 0) >= 1 for g in graphs)
        # and without sequence parallelism, the async all-reduces (gloo work handles) change nothing
        assert res["async_starts"] == 3  # the embedding's and the two row splits' sums
        assert res["fused_linears"] == 3  # c_attn, c_fc and lm_head: input-gradient all-reduces overlapped
        assert res["async_diff"] <= 1e-6, f"rank {r}: async vs synchronous {res['async_diff']}"
        assert res["lowered_async_left"] == []
        assert res["lowered_async_diff"] <= 1e-6, f"rank {r}: lowered async {res['lowered_async_diff']}"


def test_lowering_refuses_simulated_ranks() -> None:
    """Without torch.distributed the lowering names what it needs."""
    model = GPT(GPTConfig(n_layer=1))
    sm = tpcompile.shard(model, 2, example_inputs=model.example_inputs(),
                         comm=tpcompile.CommOptions(lower_c10d=True))
    with pytest.raises(tpcompile.TPCompileError, match="torch.distributed initialised"):
        tpcompile.simulate_ranks(2, lambda r: sm.rank(r))
