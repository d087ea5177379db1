"""The cost model's terms for ranks that share cores and for the runtime's measured overheads: the bubble lent to
other ranks, the optimizer step per tensor and per parameter, the pipelined microbatch's own overhead and the
overhead of each tensor-parallel collective; their cluster fields and this machine's calibration of them."""
from __future__ import annotations

import dataclasses
import json

import pytest

from tpcompile.errors import TPCompileError
from tpcompile.models import GPT, GPTConfig
from tpcompile.strategy import Cluster, calibrate, comm
from tpcompile.strategy.cluster import parse_cluster
from tpcompile.strategy.cost import Layout, estimate
from tpcompile.strategy.machine_rates import measure_compute, measure_optimizer
from tpcompile.strategy.profile import build_profile
from tpcompile.strategy.search import _price, candidates, search
from tpcompile.strategy.tp_profile import tp_profile

CPU = Cluster(gpus=4, gpus_per_node=4, flops=1e11, efficiency=0.5, memory_bw=1e10, intra_bw=1e9, inter_bw=1e9,
              intra_latency=1e-4, inter_latency=1e-4, op_overhead=1e-5, overlap=0.0, dtype="fp32")


@pytest.fixture(scope="module")
def profile():
    return build_profile(GPT(GPTConfig(n_layer=4, fused_qkv=False, tie_weights=False)), seq_len=32)


def test_ranks_sharing_cores_lend_them_through_the_bubble(profile) -> None:
    """4 ranks on 2 cores: the step is the larger of the busy time and the critical path at a whole core, so the
    bubble shrinks to what that leaves; on a core each (or 4 cores), and without a pipeline, nothing changes."""
    lay = Layout(1, 2, 2, 2)
    own = estimate(profile, None, CPU, lay, 16)
    shared = estimate(profile, None, dataclasses.replace(CPU, shared_cores=2), lay, 16)
    waits = own.time["bubble"] + own.time["imbalance"]
    busy = own.step_s - waits
    assert waits > 0 and shared.step_s == pytest.approx(max(busy, (busy + waits) / 2))
    assert shared.step_s < own.step_s and shared.time["compute"] == own.time["compute"]
    assert estimate(profile, None, dataclasses.replace(CPU, shared_cores=4), lay, 16).step_s == \
        pytest.approx(own.step_s)
    flat = Layout(1, 4, 1, 1)
    assert estimate(profile, None, dataclasses.replace(CPU, shared_cores=2), flat, 16).step_s == \
        pytest.approx(estimate(profile, None, CPU, flat, 16).step_s)


def test_search_is_exact_when_ranks_share_cores(profile) -> None:
    """The search's lower bound leaves out the bubble that shared cores take back: it still finds the fastest."""
    cluster = dataclasses.replace(CPU, shared_cores=2)
    tpps = {t: tp_profile(profile, t) for t in (2, 4)}
    result = search(profile, tpps, cluster, 16)
    every = [_price(profile, tpps.get(lay.tp), cluster, lay, 16, True)[0]
             for lay in candidates(profile, cluster, 16, True)]
    assert any(e.layout.pp > 1 for e in every)
    assert result.best.step_s == pytest.approx(min(e.step_s for e in every if e.fits))


def test_optimizer_step_per_parameter_and_tensor(profile) -> None:
    """The optimizer step reads and writes optimizer_bytes per local parameter and runs optimizer_ops ops per
    parameter tensor."""
    lay = Layout(1, 1, 1, 1)
    params = sum(b.params for b in profile.blocks)
    tensors = sum(len(b.param_names) for b in profile.blocks)
    for nbytes, ops in ((32.0, 1.0), (96.0, 12.0)):
        c = dataclasses.replace(CPU, gpus=1, gpus_per_node=1, optimizer_bytes=nbytes, optimizer_ops=ops)
        assert estimate(profile, None, c, lay, 4).time["optimizer"] == \
            pytest.approx(params * nbytes / c.memory_bw + tensors * ops * c.op_overhead)


def test_pipelined_microbatches_pay_the_pipeline_overhead(profile) -> None:
    """pipeline_overhead replaces microbatch_overhead at pp > 1 (every stage slot, bubble included); unset, the
    microbatch overhead applies there too."""
    base = dataclasses.replace(CPU, microbatch_overhead=0.01)
    piped = dataclasses.replace(base, pipeline_overhead=0.003)
    assert base.microbatch_cost(2) == 0.01 and piped.microbatch_cost(2) == 0.003 and piped.microbatch_cost(1) == 0.01
    lay = Layout(1, 1, 4, 8)
    plain = estimate(profile, None, dataclasses.replace(base, microbatch_overhead=0.0), lay, 32)
    assert estimate(profile, None, piped, lay, 32).step_s - plain.step_s == pytest.approx((8 + 3) * 0.003)
    assert estimate(profile, None, base, lay, 32).step_s - plain.step_s == pytest.approx((8 + 3) * 0.01)
    flat = Layout(1, 1, 1, 4)
    assert estimate(profile, None, piped, flat, 32).time["overhead"] == pytest.approx(4 * 0.01)


def test_each_communicating_pass_pays_the_collective_overhead(profile) -> None:
    """At tp = 2 every forward or backward pass of a collective that sends bytes costs collective_overhead more;
    at tp = 1 (no exchange) nothing."""
    tpp = tp_profile(profile, 2)
    lay = Layout(2, 1, 1, 1)
    plain = estimate(profile, tpp, CPU, lay, 8)
    slow = estimate(profile, tpp, dataclasses.replace(CPU, collective_overhead=1e-3), lay, 8)
    passes = 0
    for c in [c for bt in tpp.blocks for c in bt.collectives] + [c for u in tpp.units for c in u.collectives]:
        f, b = comm.tp_collective(c, 1.0, 2, 1e9, 0.0, False)
        passes += (f.sent > 0) + (b.sent > 0)
    assert passes > 0 and slow.time["tp_comm"] - plain.time["tp_comm"] == pytest.approx(passes * 1e-3)
    one = Layout(1, 1, 1, 1)
    assert estimate(profile, tp_profile(profile, 1), dataclasses.replace(CPU, collective_overhead=1e-3), one,
                    8).step_s == pytest.approx(estimate(profile, tp_profile(profile, 1), CPU, one, 8).step_s)


def test_cluster_file_reads_the_runtime_fields() -> None:
    """The new fields read from a cluster file as quantities; bad values name the field."""
    c = parse_cluster("gpus: 4\nshared_cores: 2\noptimizer_bytes: 96B\noptimizer_ops: 12\n"
                      "pipeline_overhead: 3ms\ncollective_overhead: 200us\n")
    assert (c.shared_cores, c.optimizer_bytes, c.optimizer_ops) == (2, 96.0, 12.0)
    assert c.pipeline_overhead == pytest.approx(3e-3) and c.collective_overhead == pytest.approx(2e-4)
    with pytest.raises(TPCompileError, match="optimizer_ops: 'many' is not a number"):
        parse_cluster("gpus: 4\noptimizer_ops: many\n")
    with pytest.raises(TPCompileError, match="shared_cores must be an int >= 0"):
        Cluster(gpus=4, shared_cores=-1)


def test_this_machine_carries_the_calibrated_runtime_fields(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """this_machine(r) shares its cores between the ranks and divides the runtime's overheads likewise."""
    monkeypatch.setenv("TPCOMPILE_CACHE_DIR", str(tmp_path))
    data = {"matmul_flops": 5e10, "memory_bw": 1e10, "op_overhead": 1e-5, "alpha": 2e-4, "bandwidth": 1e9,
            "nominal_flops": 1e11, "cores": 2, "optimizer_bytes": 60.0, "optimizer_ops": 9.0,
            "pipeline_overhead": 0.004, "collective_overhead": 3e-4}
    (tmp_path / "calibration.json").write_text(json.dumps({calibrate._fingerprint(): data}))
    two, four = calibrate.this_machine(2), calibrate.this_machine(4)
    assert (two.shared_cores, two.optimizer_bytes, two.optimizer_ops) == (2, 60.0, 9.0)
    assert two.pipeline_overhead == pytest.approx(0.004) and four.pipeline_overhead == pytest.approx(0.008)
    assert two.collective_overhead == pytest.approx(3e-4) and four.collective_overhead == pytest.approx(6e-4)
    older = {k: v for k, v in data.items() if k not in ("pipeline_overhead", "optimizer_bytes")}
    (tmp_path / "calibration.json").write_text(json.dumps({calibrate._fingerprint(): older}))
    assert calibrate.this_machine(2).pipeline_overhead is None and calibrate.this_machine(2).optimizer_bytes == 32.0


def test_measured_optimizer_cost_predicts_another_parameter_set() -> None:
    """The two AdamW timings this machine's calibration fits predict a third parameter set's step within 3x."""
    import time

    import torch
    rates = measure_compute()
    fit = measure_optimizer(rates["memory_bw"], rates["op_overhead"])
    torch.set_num_threads(1)
    params = [torch.nn.Parameter(torch.randn(1 << 16)) for _ in range(16)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params)
    opt.step()
    best = min(_timed(opt.step, time) for _ in range(5))
    predicted = 16 * fit["optimizer_ops"] * rates["op_overhead"] + 16 * (1 << 16) * fit["optimizer_bytes"] / \
        rates["memory_bw"]
    assert predicted / 3 < best < predicted * 3


def _timed(fn, time) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
