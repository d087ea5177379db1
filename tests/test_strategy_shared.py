"""Ranks that are processes taking turns on fewer cores (this machine): a rank waiting in the pipeline
bubble or on a slower stage lends its core to the others, so the step is the larger of the busy time and
the critical path at a whole core's speed; the search stays exact. The optimizer step's bytes per parameter
and ops per tensor (a fused Adam on GPUs, torch's single-tensor AdamW here). The fields read from a cluster
file."""
from __future__ import annotations

import dataclasses
import json

import pytest

from tpcompile.errors import TPCompileError
from tpcompile.models import GPT, GPTConfig
from tpcompile.strategy import Cluster, calibrate
from tpcompile.strategy.cluster import parse_cluster
from tpcompile.strategy.cost import Layout, estimate
from tpcompile.strategy.profile import build_profile
from tpcompile.strategy.search import _price, candidates, search
from tpcompile.strategy.tp_profile import tp_profile

CPU = Cluster(gpus=4, gpus_per_node=4, flops=1e11, efficiency=0.5, memory_bw=1e10, intra_bw=1e9, inter_bw=1e9,
              intra_latency=1e-4, inter_latency=1e-4, op_overhead=1e-5, overlap=0.0, dtype="fp32")


@pytest.fixture(scope="module")
def profile():
    return build_profile(GPT(GPTConfig(n_layer=4, fused_qkv=False, tie_weights=False)), seq_len=32)


def test_ranks_sharing_cores_lend_them_through_the_bubble(profile) -> None:
    """4 ranks on 2 cores: the bubble shrinks to what the critical path at a whole core leaves; with a core per
    rank (4 cores), and without a pipeline, nothing changes."""
    lay = Layout(1, 2, 2, 2)
    own = estimate(profile, None, CPU, lay, 16)
    shared = estimate(profile, None, dataclasses.replace(CPU, shared_cores=2), lay, 16)
    waits = own.time["bubble"] + own.time["imbalance"]
    busy = own.step_s - waits
    assert waits > 0 and shared.step_s == pytest.approx(max(busy, (busy + waits) / 2))
    assert shared.step_s < own.step_s and shared.time["compute"] == own.time["compute"]
    assert shared.step_s == pytest.approx(sum(shared.time.values()))
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


def test_optimizer_step_per_parameter_and_per_tensor(profile) -> None:
    """The optimizer term is optimizer_bytes per local parameter at memory_bw plus optimizer_ops per tensor."""
    lay = Layout(1, 1, 1, 1)
    base = estimate(profile, None, CPU, lay, 16).time["optimizer"]
    more_bytes = estimate(profile, None, dataclasses.replace(CPU, optimizer_bytes=80.0), lay, 16).time["optimizer"]
    more_ops = estimate(profile, None, dataclasses.replace(CPU, optimizer_ops=10.0), lay, 16).time["optimizer"]
    params = sum(b.params for b in profile.blocks)
    tensors = sum(len(b.param_names) for b in profile.blocks)
    assert more_bytes - base == pytest.approx(params * 48.0 / CPU.memory_bw)
    assert more_ops - base == pytest.approx(tensors * 9.0 * CPU.op_overhead)
    sharded = estimate(profile, None, dataclasses.replace(CPU, optimizer_bytes=80.0),
                       Layout(1, 4, 1, 1, data_parallel="fsdp"), 16)
    assert sharded.time["optimizer"] < more_bytes


def test_shared_cores_from_a_cluster_file_and_this_machine(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The field reads from a cluster file and is checked; this_machine sets its core count and torch's AdamW."""
    c = parse_cluster("gpus: 4\nshared_cores: 2\noptimizer_bytes: 80B\noptimizer_ops: 10\n")
    assert (c.shared_cores, c.optimizer_bytes, c.optimizer_ops) == (2, 80.0, 10.0)
    c = parse_cluster("gpus: 4\n")
    assert (c.shared_cores, c.optimizer_bytes, c.optimizer_ops) == (0, 32.0, 1.0)
    with pytest.raises(TPCompileError, match="optimizer_ops: 'many' is not a number"):
        parse_cluster("gpus: 4\noptimizer_ops: many\n")
    with pytest.raises(TPCompileError, match="optimizer_bytes must be positive"):
        Cluster(gpus=4, optimizer_bytes=0.0)
    with pytest.raises(TPCompileError, match="shared_cores must be an int >= 0"):
        Cluster(gpus=4, shared_cores=-1)
    monkeypatch.setenv("TPCOMPILE_CACHE_DIR", str(tmp_path))
    data = {"matmul_flops": 5e10, "memory_bw": 1e10, "op_overhead": 1e-5, "alpha": 2e-4, "bandwidth": 1e9,
            "nominal_flops": 1e11, "cores": 2}
    (tmp_path / "calibration.json").write_text(json.dumps({calibrate._fingerprint(): data}))
    four = calibrate.this_machine(4)
    assert (four.shared_cores, four.optimizer_bytes, four.optimizer_ops) == \
        (2, calibrate.ADAMW_BYTES, calibrate.ADAMW_OPS)
