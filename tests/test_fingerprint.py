"""The startup check: ranks compare their collective schedules and mismatches fail fast, naming the collective."""
from __future__ import annotations

import copy
import operator
import threading

import pytest
import torch
from dist_run import results

import tpcompile
from tpcompile.models import GPT, GPTConfig
from tpcompile.ops import collectives as C
from tpcompile.ops.schedule import CollectiveCall
from tpcompile.runtime.startup_check import digest, first_difference, schedule


def _schedules(cfg: GPTConfig, ws: int = 2) -> tuple[tpcompile.ShardedModel, list]:
    """(sharded model, each rank's schedule), traced on fake tensors with a registered world size."""
    C.register_group("fp", ws)
    sm = tpcompile.shard(GPT(cfg), ws, group="fp")
    fake = [n.meta["val"] for n in sm.captured.graph.nodes if n.op == "placeholder"]
    return sm, [schedule(sm.rank(r), fake) for r in range(ws)]


@pytest.fixture(scope="module")
def gpt() -> tuple[tpcompile.ShardedModel, list]:
    """The bundled-size GPT at 2 ranks and its schedules, made once for this file."""
    try:
        yield _schedules(GPTConfig())
    finally:
        C.unregister_group("fp")


def test_schedule_is_symbolic_and_is_what_runs(gpt: tuple) -> None:
    """Ranks' schedules agree, use symbolic batch/length, and match the collectives a forward executes."""
    sm, (s0, s1) = gpt
    assert s0 == s1 and digest(s0) == digest(s1)
    # the vocabulary embedding's, then one per attention block and one per MLP
    assert [e[0] for e in s0].count("all_reduce") == 5
    assert s0[-1][:2] == ("all_gather_replicated", ("d0", "d1", "128"))
    idx = torch.randint(0, 256, (3, 5))
    with C.record() as events:
        tpcompile.simulate(sm, idx)
    ran = [(e.op, e.shape) for e in events if e.rank == 0 and e.phase == "forward"]
    sizes = {"d0": 3, "d1": 5}
    planned = [(op, tuple(sizes.get(d, int(d) if d.isdigit() else d) for d in shape))
               for op, shape, _, _ in s0 if op in C.FORWARD_COLLECTIVES]
    assert ran == planned


def test_a_removed_collective_is_named(gpt: tuple) -> None:
    """Rank 1's graph with its first all_reduce cut out differs at that index, named with both sides."""
    sm, (s0, _) = gpt
    gm = copy.deepcopy(sm.rank(1))
    node = next(n for n in gm.graph.nodes if getattr(n.target, "_opname", "") == "all_reduce")
    index = [getattr(n.target, "_opname", None) for n in gm.graph.nodes
             if getattr(n.target, "namespace", None) == "tpcompile"].index("all_reduce")
    node.replace_all_uses_with(node.args[0])
    gm.graph.erase_node(node)
    gm.recompile()
    fake = [n.meta["val"] for n in sm.captured.graph.nodes if n.op == "placeholder"]
    why = first_difference([s0, schedule(gm, fake)])
    assert why is not None
    assert f"at collective #{index}: rank 0 issues all_reduce((d0, d1, 64), torch.float32, group)" in why
    assert f"rank 1 issues {s0[index + 1][0]}" in why
    assert first_difference([s0, s0, s0]) is None


def test_different_models_differ(gpt: tuple) -> None:
    """A model with one more block has a different schedule; the shorter one 'ends here'."""
    _, (a, _) = gpt
    _, (b, _) = _schedules(GPTConfig(n_layer=3))
    assert digest(a) != digest(b)
    assert "collective #" in first_difference([a, b])
    assert "nothing (its schedule ends here)" in first_difference([a, a[:-1]])


@pytest.mark.gloo
@pytest.mark.parametrize("rank", [0, 1])
def test_mismatching_ranks_fail_fast_with_the_first_difference(rank: int) -> None:
    """Two gloo ranks given different models (rank 1 has 3 blocks) both raise at once, naming the first tensor."""
    res = results()["ranks"][rank]
    assert res["mismatch"] is not None
    assert res["mismatch"].startswith("tpcompile.parallelize: the ranks hold different models: at tensor #")
    assert "rank 1 has transformer.h.2.ln_1.weight (64 float32)" in res["mismatch"]
    assert res["mismatch_s"] < 60  # the exchange comes before capture; a hang would sit out the 240 s launch
    assert operator.eq(results()["ranks"][0]["mismatch"], results()["ranks"][1]["mismatch"])


def test_untraceable_graph_falls_back_to_graph_order(gpt: tuple, caplog: pytest.LogCaptureFixture) -> None:
    """If fake tracing fails, the schedule is the collectives in graph order, shapes unknown, with a warning."""
    sm, (s0, _) = gpt
    with caplog.at_level("WARNING", logger="tpcompile"):
        fake = [n.meta["val"].float() for n in sm.captured.graph.nodes if n.op == "placeholder"]
        rough = schedule(sm.rank(0), fake)  # float token ids: the embedding cannot run
    assert [e[0] for e in rough] == [e[0] for e in s0]
    assert {e[1] for e in rough} == {("?",)}
    assert "fake-tensor tracing failed" in caplog.text


def test_bucketed_gradient_syncs_are_read_with_their_shapes(caplog: pytest.LogCaptureFixture) -> None:
    """With comm=True (and norms on token shares) the fake run reads the bucket op: each member's shape, no fallback."""
    C.register_group("fpb", 2)
    try:
        sm = tpcompile.shard(GPT(GPTConfig(n_layer=1)), 2, group="fpb", comm=True, sequence_parallel=True)
        fake = [n.meta["val"] for n in sm.captured.graph.nodes if n.op == "placeholder"]
        with caplog.at_level("WARNING", logger="tpcompile"):
            entries = schedule(sm.rank(0), fake)
    finally:
        C.unregister_group("fpb")
    assert "fake-tensor tracing failed" not in caplog.text
    buckets = [e for e in entries if e.op == "grad_bucket_all_reduce"]
    assert buckets and all(d.startswith("(") for e in buckets for d in e.shape)
    assert any(e.shape[0] == "(64)" for e in buckets)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_padded_heads_keep_the_schedule_symbolic(sequence_parallel: bool, caplog: pytest.LogCaptureFixture) -> None:
    """The bundled GPT's 4 heads at 3 ranks (padded 2|2|0; with sequence parallelism, tokens in shares that differ
    by one): each rank, capturing on its own as under torchrun, traces a symbolic schedule equal to every other's
    (a zero-padded block's pad is traced symbolically, not at the example's sizes)."""
    one_at_a_time = threading.Lock()  # simulated ranks are threads; tracing shares torch's global state

    def traced(rank: int) -> list:
        with one_at_a_time:
            sm = tpcompile.shard(GPT(GPTConfig(n_layer=1)), 3, sequence_parallel=sequence_parallel)
            fake = [n.meta["val"] for n in sm.captured.graph.nodes if n.op == "placeholder"]
            return schedule(sm.rank(rank), fake)

    with caplog.at_level("WARNING", logger="tpcompile"):
        schedules = tpcompile.simulate_ranks(3, traced)
    assert "fake-tensor tracing failed" not in caplog.text
    assert first_difference(schedules) is None
    assert all(e.shape[:2] == ("d0", "d1") for e in schedules[2] if e.op == "all_reduce"), schedules[2]


def test_a_share_of_one_example_token_keeps_the_schedule_symbolic() -> None:
    """GPT-2 (tokens flattened with the batch) with sequence parallelism at 5 ranks on an 8-token example: ranks 3
    and 4 hold 1 token of it, which the trace takes as a size (>= 2), not as the fixed 1 that would make their
    schedules differ from the others' (`all_gather((d0, (d1//5), (64//(((d1 + 1)//5)))))` on rank 3)."""
    import hf_models

    arch = next(a for a in hf_models.ARCHS if a.name == "gpt2")
    one_at_a_time = threading.Lock()

    def traced(rank: int) -> list:
        with one_at_a_time:
            sm = tpcompile.shard(hf_models.build(arch), 5, example_kwargs=hf_models.inputs(arch, 2, 8),
                                 sequence_parallel=True)
            fake = [n.meta["val"] for n in sm.captured.graph.nodes if n.op == "placeholder"]
            return schedule(sm.rank(rank), fake)

    schedules = tpcompile.simulate_ranks(5, traced)
    assert first_difference(schedules) is None
    assert schedules[3] == schedules[0] and ("?",) not in {e.shape for e in schedules[3]}


def test_a_rank_traced_without_shapes_matches_on_op_and_arguments(caplog: pytest.LogCaptureFixture) -> None:
    """A trace that fixes an input size at the example's (here `int()` of the length) gives that rank's schedule
    without shapes, which matches another rank's on op and arguments alone; ops or arguments still differ."""
    sm = tpcompile.shard(GPT(GPTConfig(n_layer=1)), 2)
    fake = [n.meta["val"] for n in sm.captured.graph.nodes if n.op == "placeholder"]
    g = torch.fx.Graph()
    x = g.placeholder("idx")
    length = g.call_function(int, (g.call_function(torch.ops.aten.sym_size.int, (x, 1)),))
    part = g.call_function(torch.ops.aten.narrow.default, (x, 1, 0, length))
    g.output(g.call_function(torch.ops.tpcompile.all_reduce.default, (part, "fp")))
    with caplog.at_level("INFO", logger="tpcompile"):
        fixed = schedule(torch.fx.GraphModule(torch.nn.Module(), g), fake)
    assert fixed == [CollectiveCall("all_reduce", ("?",), "?", ("group",))]
    assert "tracing fixed a symbolic size" in caplog.text
    shaped = CollectiveCall("all_reduce", ("d0", "d1"), "torch.int64", ("group",))
    assert first_difference([[shaped], fixed]) is None
    assert first_difference([[shaped._replace(op="all_gather")], fixed]) is not None
    assert first_difference([[shaped], [shaped._replace(shape=("d0", "8"))]]) is not None
