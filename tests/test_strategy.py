"""The planner's model of a model: FLOPs, blocks, per-degree costs read from tpcompile's plan, the optimal
pipeline cut, the cost model's parts, per-unit decisions, and the search's exactness."""
from __future__ import annotations

import itertools
import json
import math
import random

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import tpcompile
from tpcompile.models import GPT, GPTConfig, MLPStack
from tpcompile.ops.schedule import graph_schedule
from tpcompile.strategy import Cluster, plan_parallel
from tpcompile.strategy import calibrate
from tpcompile.strategy.block_graph import block_graph, partition
from tpcompile.strategy.cost import STATE_BYTES, Layout, estimate
from tpcompile.strategy.profile import build_profile
from tpcompile.strategy.search import _price, candidates, search
from tpcompile.strategy.tp_profile import tp_profile

SEQ = 32


def _llama(layers: int = 2, attn: str = "sdpa") -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                      vocab_size=128, num_hidden_layers=layers, use_cache=False, attn_implementation=attn)
    return LlamaForCausalLM(cfg).eval()


LLAMA_KW = {"input_ids": torch.ones(1, 4, dtype=torch.long), "use_cache": False}


@pytest.fixture(scope="module")
def gpt_profile():
    """A bundled GPT (separate q/k/v, written-out attention) captured once for the module."""
    return build_profile(GPT(GPTConfig(n_layer=4, fused_qkv=False, tie_weights=False)), seq_len=SEQ)


@pytest.mark.parametrize("name", ["gpt-manual", "llama-eager", "mlp"])
def test_flops_equal_torch_flop_counter(name: str) -> None:
    """Forward matmul FLOPs read off the graph equal torch's FlopCounterMode on a real forward."""
    if name == "gpt-manual":
        model, kw, run = GPT(GPTConfig(attention="manual")), {}, lambda m: m(torch.randint(0, 256, (3, SEQ)))
    elif name == "llama-eager":
        model, kw = _llama(attn="eager"), {"example_kwargs": LLAMA_KW}
        run = lambda m: m(input_ids=torch.randint(0, 128, (3, SEQ)), use_cache=False)  # noqa: E731
    else:
        model, kw, run = MLPStack(), {}, lambda m: m(torch.randn(3, 64))
    profile = build_profile(model, seq_len=SEQ, **kw)
    with FlopCounterMode(display=False) as counter:
        run(model)
    assert sum(b.flops for b in profile.blocks) * 3 == pytest.approx(counter.get_total_flops(), rel=1e-9)


def test_blocks_follow_the_repeated_layers(gpt_profile) -> None:
    """The chain is pre, one block per layer, post; parameters counted once; each boundary carries (T, C) per sample."""
    names = [b.name for b in gpt_profile.blocks]
    assert names == ["pre"] + [f"transformer.h.{i}" for i in range(4)] + ["post"]
    model = GPT(GPTConfig(n_layer=4, fused_qkv=False, tie_weights=False))
    assert gpt_profile.params == sum(p.numel() for p in model.parameters())
    assert all(b.out == SEQ * 64 for b in gpt_profile.blocks[:-1]) and gpt_profile.blocks[-1].out == 0
    assert [b.repeated for b in gpt_profile.blocks] == [False, True, True, True, True, False]


def test_tp_profile_reads_tpcompile_plan_and_rank_graph() -> None:
    """Per-rank parameters and collectives at degree 2 are those of shard()'s plan and rank 0's graph."""
    model = _llama()
    profile = build_profile(model, example_kwargs=LLAMA_KW, seq_len=SEQ)
    tpp = tp_profile(profile, 2)
    sm = tpcompile.shard(model, 2, example_kwargs={"input_ids": torch.ones(2, SEQ, dtype=torch.long),
                                                   "use_cache": False})
    local = sum(math.prod(p.local_shape) for p in sm.plan.parameters.values())
    assert sum(b.params for b in tpp.blocks) == local
    counted = sum(len(u.collectives) for u in tpp.units) + sum(len(b.collectives) for b in tpp.blocks)
    assert counted == len(graph_schedule(sm.rank(0)))
    attn = next(u for u in tpp.units if u.name == "model.layers.0.self_attn")
    assert attn.flops_rank == pytest.approx(attn.flops_full / 2) and attn.params_rank * 2 == attn.params_full
    # per-sample bytes of the row split's all-reduce: the hidden state (T, C)
    assert any(c.op == "all_reduce" and c.elems == SEQ * 64 for c in attn.collectives)


def test_default_gradient_bucket_is_priced_as_one_backward_all_reduce() -> None:
    """At degree 4 (2 kv heads: kv pieces) the profile holds the gradient bucket shard()'s default passes emit,
    priced as one backward all-reduce of its flattened elements and nothing in forward, as it runs."""
    from tpcompile.strategy import comm
    model = _llama()
    tpp = tp_profile(build_profile(model, example_kwargs=LLAMA_KW, seq_len=SEQ), 4)
    colls = [c for u in tpp.units for c in u.collectives] + [c for b in tpp.blocks for c in b.collectives]
    buckets = [c for c in colls if c.op == "grad_bucket_all_reduce"]
    assert buckets and not any(c.op == "grad_piece_all_reduce" for c in colls)
    sm = tpcompile.shard(model, 4, example_kwargs={"input_ids": torch.ones(2, SEQ, dtype=torch.long),
                                                   "use_cache": False})
    ran = [call for call, _ in graph_schedule(sm.rank(0)) if call.op == "grad_bucket_all_reduce"]
    assert len(ran) == len(buckets)
    fwd, bwd = comm.tp_collective(buckets[0], buckets[0].elems * 4, 4, 100e9, 1e-5, False)
    assert fwd == comm.ZERO and bwd == comm.all_reduce(buckets[0].elems * 4, 4, 100e9, 1e-5)


def test_degrees_share_one_capture() -> None:
    """Running the passes at degree 4 after degree 2 on one capture reads the same costs as a fresh capture."""
    model = _llama()
    shared = build_profile(model, example_kwargs=LLAMA_KW, seq_len=SEQ)
    tp_profile(shared, 2)
    again = tp_profile(shared, 4)
    fresh = tp_profile(build_profile(model, example_kwargs=LLAMA_KW, seq_len=SEQ), 4)
    assert [(u.name, u.flops_rank, u.params_rank, u.collectives) for u in again.units] == \
        [(u.name, u.flops_rank, u.params_rank, u.collectives) for u in fresh.units]
    assert [b.params for b in again.blocks] == [b.params for b in fresh.blocks]


def _brute_force(times: list[float], send: list[float], stages: int, mem, cap: float):
    """Every cut into `stages` contiguous stages, the one with the lexicographically smallest sorted stage times."""
    n, best = len(times), None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = list(zip((0, *cuts), (*cuts, n)))
        if any(mem(i, j, s) > cap for s, (i, j) in enumerate(bounds)):
            continue
        cost = sorted((sum(times[i:j]) + (send[j - 1] if j < n else 0.0) for i, j in bounds), reverse=True)
        if best is None or cost < best:
            best = cost
    return best


@pytest.mark.parametrize("seed", range(6))
def test_pipeline_cut_is_optimal(seed: int) -> None:
    """The shortest path over cut points finds the cut whose sorted stage times are smallest, memory respected."""
    rng = random.Random(seed)
    n, stages = rng.randint(5, 9), rng.randint(2, 4)
    times = [rng.uniform(0.5, 3.0) for _ in range(n)]
    send = [rng.uniform(0.0, 0.3) for _ in range(n - 1)] + [0.0]
    acts = [rng.uniform(1, 4) for _ in range(n)]
    mem = lambda i, j, s: sum(acts[i:j]) * (stages - s)  # noqa: E731  (earlier stages hold more microbatches)
    cap = sum(acts) * 1.2
    g = block_graph([f"b{i}" for i in range(n)], times, [0.0] * n, acts, [0.0] * n, send[:-1])
    got = partition(g, stages, mem, cap)
    want = _brute_force(times, send, stages, mem, cap)
    if want is None:
        assert got is None
    else:
        assert sorted(got.times, reverse=True) == pytest.approx(want)
        assert all(mem(i, j, s) <= cap for s, (i, j) in enumerate(got.bounds))


FAST = Cluster(gpus=8, gpus_per_node=8, intra_latency=0.0, inter_latency=0.0, intra_bw=1e15, inter_bw=1e15)


def test_step_parts_add_up_and_bubble(gpt_profile) -> None:
    """The step is the sum of its parts; the 1F1B bubble is (p - 1) times the slowest stage, read off the block graph."""
    est = estimate(gpt_profile, None, FAST, Layout(1, 2, 4, 8), 32)
    assert est.step_s == pytest.approx(sum(est.time.values()))
    names = [b.name for b in gpt_profile.blocks]
    stage_times = [sum(est.graph.nodes[names[k]]["time"] for k in range(i, j))
                   + (est.graph.edges[names[j - 1], names[j]]["send_s"] if j < len(names) else 0.0)
                   for i, j in est.stages]
    assert len(stage_times) == 4 and est.time["bubble"] == pytest.approx(3 * max(stage_times))
    assert est.time["compute"] + est.time["tp_comm"] + est.time["pp_comm"] + est.time["imbalance"] == \
        pytest.approx(8 * max(stage_times))


def test_step_overhead_once_per_training_step(gpt_profile) -> None:
    """The cluster's step_overhead is added once to a training step, whatever the microbatches; not to inference."""
    import dataclasses
    slow = dataclasses.replace(FAST, step_overhead=0.05)
    for lay in (Layout(1, 1, 1, 1), Layout(1, 2, 4, 8)):
        assert estimate(gpt_profile, None, slow, lay, 32).step_s - estimate(gpt_profile, None, FAST, lay, 32).step_s \
            == pytest.approx(0.05, rel=1e-6)
    lay = Layout(1, 1, 1, 1)
    assert estimate(gpt_profile, None, slow, lay, 32, training=False).step_s == \
        pytest.approx(estimate(gpt_profile, None, FAST, lay, 32, training=False).step_s)


def test_runtime_overheads_per_microbatch_and_fsdp_call(gpt_profile) -> None:
    """Every stage pays microbatch_overhead per microbatch (bubble included); FSDP pays fsdp_overhead per block and call."""
    import dataclasses
    slow = dataclasses.replace(FAST, microbatch_overhead=0.01, fsdp_overhead=0.002)
    plain = estimate(gpt_profile, None, FAST, Layout(1, 2, 4, 8), 32)
    over = estimate(gpt_profile, None, slow, Layout(1, 2, 4, 8), 32)
    assert over.time["overhead"] == pytest.approx(8 * 0.01)
    assert over.step_s - plain.step_s == pytest.approx((8 + 3) * 0.01, rel=1e-6)
    ddp = estimate(gpt_profile, None, slow, Layout(1, 1, 1, 2), 32)
    fsdp = estimate(gpt_profile, None, slow, Layout(1, 1, 1, 2, data_parallel="fsdp"), 32)
    blocks = len(gpt_profile.blocks)
    assert fsdp.step_s - ddp.step_s == pytest.approx(blocks * (2 * 2 + 1) * 0.002, rel=1e-6)


def test_memory_model_parts(gpt_profile) -> None:
    """16 B per parameter, divided by dp under FSDP; recompute, sequence parallelism and microbatches cut activations."""
    tpp = tp_profile(gpt_profile, 2)
    base = Layout(2, 4, 1, 1)
    ddp = estimate(gpt_profile, tpp, FAST, base, 32)
    fsdp = estimate(gpt_profile, tpp, FAST, Layout(2, 4, 1, 1, data_parallel="fsdp"), 32)
    assert ddp.memory_parts["states"] == pytest.approx(sum(b.params for b in tpp.blocks) * STATE_BYTES)
    assert fsdp.memory_parts["states"] == pytest.approx(ddp.memory_parts["states"] / 4)
    act = ddp.memory_parts["activations"]
    assert estimate(gpt_profile, tpp, FAST, Layout(2, 4, 1, 1, recompute=True), 32).memory_parts["activations"] < act
    assert estimate(gpt_profile, tpp, FAST, Layout(2, 4, 1, 1, sequence_parallel=True), 32).memory_parts[
        "activations"] < act
    assert estimate(gpt_profile, tpp, FAST, Layout(2, 4, 1, 2), 32).memory_parts["activations"] == \
        pytest.approx(act / 2)


def test_slow_links_keep_units_whole_and_the_plan_shards_exactly() -> None:
    """Over slow links every unit stays replicated, with the reason; the plan= it gives shards to the same numbers."""
    model = GPT(GPTConfig(fused_qkv=False, tie_weights=False))
    slow = Cluster(gpus=2, gpus_per_node=2, intra_bw=1e3, intra_latency=1.0)
    fast = Cluster(gpus=2, gpus_per_node=2, intra_bw=1e15, intra_latency=0.0, inter_latency=0.0,
                   flops=1e9, efficiency=1.0)
    profile = build_profile(model, seq_len=SEQ)
    tpps = {2: tp_profile(profile, 2)}
    _, slow_why = _price(profile, tpps[2], slow, Layout(2, 1, 1, 1), 8, True)
    _, fast_why = _price(profile, tpps[2], fast, Layout(2, 1, 1, 1), 8, True)
    cost_model = [d for d in slow_why if not d.why.startswith("replicated by")]
    assert cost_model and all(not d.split and "collective" in d.why for d in cost_model)
    assert all(d.split for d in fast_why if not d.why.startswith("replicated by"))
    plan = {p: "replicate" for d in cost_model for p in d.paths}
    sm = tpcompile.shard(model, 2, plan=plan)
    idx = torch.randint(0, 256, (2, 16))
    ref = model(idx)
    for out in tpcompile.simulate(sm, idx):
        torch.testing.assert_close(out, ref)


def test_search_is_exact(gpt_profile) -> None:
    """The pruned search finds the same fastest layout as pricing every candidate."""
    cluster = Cluster(gpus=4, gpus_per_node=4, gpu_memory=2e6, memory_margin=0.0)
    tpps = {t: tp_profile(gpt_profile, t) for t in (2, 4)}
    result = search(gpt_profile, tpps, cluster, 16)
    every = [_price(gpt_profile, tpps.get(lay.tp), cluster, lay, 16, True)[0]
             for lay in candidates(gpt_profile, cluster, 16, True)]
    fitting = [e for e in every if e.fits]
    assert fitting and len(fitting) < len(every)  # the memory limit matters here
    assert result.best.step_s == pytest.approx(min(e.step_s for e in fitting))


def test_plan_parallel_on_meta_allocates_no_weights() -> None:
    """A model built on the meta device plans without leaving it; factories and MODEL strings are built there."""
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2))
    s = plan_parallel(model, {"gpus": 4, "gpus_per_node": 4}, global_batch=8, seq_len=SEQ)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert s.tp * s.dp * s.pp == 4 and s.memory_per_gpu_bytes > 0
    assert plan_parallel(lambda: MLPStack(), {"gpus": 2}, global_batch=4, seq_len=None).seq_len == 1
    assert plan_parallel("hf:llama", Cluster(gpus=2), global_batch=4, seq_len=16).model == "LlamaForCausalLM"


def test_strategy_record_feeds_the_runtime() -> None:
    """mesh and train_kwargs are what init_mesh and parallelize_train take; to_dict is JSON; the table lists alternatives."""
    import inspect
    s = plan_parallel(GPT(GPTConfig(n_layer=2)), Cluster(gpus=4, gpus_per_node=4), global_batch=8, seq_len=SEQ)
    assert set(s.mesh) == {"dp", "tp", "pp"}
    accepted = set(inspect.signature(tpcompile.parallelize_train).parameters)
    assert set(s.train_kwargs) <= accepted and s.train_kwargs["microbatches"] == s.microbatches
    data = json.loads(json.dumps(s.to_dict()))
    assert data["tp"] == s.tp and len(data["alternatives"]) == len(s.alternatives)
    assert s.table().count(" x dp ") >= 2 and "chosen" in s.table()


def test_strategy_asks_the_runtime_for_the_precision_it_priced() -> None:
    """A bf16 cluster's strategy passes mixed_precision='bf16' to parallelize_train; an fp32 cluster's passes None."""
    for dtype, want in (("bf16", "bf16"), ("fp32", None)):
        s = plan_parallel(GPT(GPTConfig(n_layer=2)), Cluster(gpus=2, dtype=dtype), global_batch=8, seq_len=SEQ)
        assert s.train_kwargs["mixed_precision"] == want and s.to_dict()["mixed_precision"] == want


def test_this_machine_reads_the_cache(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The calibration is read from its cache without measuring; ranks beyond the cores divide the rates."""
    monkeypatch.setenv("TPCOMPILE_CACHE_DIR", str(tmp_path))
    data = {"matmul_flops": 5e10, "memory_bw": 1e10, "op_overhead": 1e-5, "alpha": 2e-5, "bandwidth": 1e9,
            "nominal_flops": 1e11, "cores": 2, "microbatch_overhead": 0.03, "fsdp_overhead": 0.004}
    (tmp_path / "calibration.json").write_text(json.dumps({calibrate._fingerprint(): data}))
    monkeypatch.setattr(calibrate, "measure_compute", lambda: pytest.fail("measured again"))
    two, four = calibrate.this_machine(2), calibrate.this_machine(4)
    assert two.efficiency == pytest.approx(0.5) and two.matmul_rate == pytest.approx(5e10)
    assert four.matmul_rate == pytest.approx(2.5e10) and four.op_overhead == pytest.approx(2e-5)
    assert two.microbatch_overhead == pytest.approx(0.03) and four.fsdp_overhead == pytest.approx(0.008)


def test_this_machine_slows_compute_by_the_measured_contention(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One rank computes at the rates measured alone; with every core running a rank, matmuls and memory-bound ops
    run at the rates measured with all cores busy (in between: linear in the busy cores); the step overhead is
    paid once per training step, not per microbatch, and not in inference."""
    monkeypatch.setenv("TPCOMPILE_CACHE_DIR", str(tmp_path))
    data = {"matmul_flops": 5e10, "memory_bw": 1e10, "op_overhead": 1e-5, "alpha": 2e-5, "bandwidth": 1e9,
            "nominal_flops": 1e11, "cores": 4, "matmul_contention": 1.3, "memory_contention": 2.5,
            "step_overhead": 0.02}
    (tmp_path / "calibration.json").write_text(json.dumps({calibrate._fingerprint(): data}))
    one, three, four = (calibrate.this_machine(r) for r in (1, 3, 4))
    assert one.matmul_rate == pytest.approx(5e10) and one.memory_bw == pytest.approx(1e10)
    assert three.matmul_rate == pytest.approx(5e10 / 1.2) and three.memory_bw == pytest.approx(1e10 / 2.0)
    assert four.matmul_rate == pytest.approx(5e10 / 1.3) and four.memory_bw == pytest.approx(1e10 / 2.5)
    assert four.step_overhead == pytest.approx(0.02) and calibrate.this_machine(8).step_overhead == pytest.approx(0.04)


def test_this_machine_takes_gloo_latency_measured_at_the_most_ranks_not_above(tmp_path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks 2-3 get the 2-process latency, 4 the 4-process one, 8 the 4-process one times the extra sharing;
    a calibration without them scales the 2-process numbers as before."""
    monkeypatch.setenv("TPCOMPILE_CACHE_DIR", str(tmp_path))
    data = {"matmul_flops": 5e10, "memory_bw": 1e10, "op_overhead": 1e-5, "alpha": 2e-4, "bandwidth": 1e9,
            "nominal_flops": 1e11, "cores": 2, "alpha_2": 2e-4, "bandwidth_2": 1e9, "alpha_4": 3e-3,
            "bandwidth_4": 4e8}
    (tmp_path / "calibration.json").write_text(json.dumps({calibrate._fingerprint(): data}))
    two, three, four, eight = (calibrate.this_machine(r) for r in (2, 3, 4, 8))
    assert two.intra_latency == pytest.approx(2e-4) and two.intra_bw == pytest.approx(1e9)
    assert three.intra_latency == pytest.approx(2e-4 * 1.5)
    assert four.intra_latency == pytest.approx(3e-3) and four.intra_bw == pytest.approx(4e8)
    assert eight.intra_latency == pytest.approx(6e-3) and eight.intra_bw == pytest.approx(2e8)
    old = {k: v for k, v in data.items() if not k[-2:] in ("_2", "_4")}
    (tmp_path / "calibration.json").write_text(json.dumps({calibrate._fingerprint(): old}))
    assert calibrate.this_machine(4).intra_latency == pytest.approx(4e-4)
