"""Ranks that are processes taking turns on fewer cores (this machine): a rank waiting in the pipeline
bubble or on a slower stage lends its core to the others, so the step is the larger of the busy time and
the critical path at a whole core's speed; the search stays exact; the field reads from a cluster file."""
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


def test_shared_cores_from_a_cluster_file_and_this_machine(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The field reads from a cluster file and is checked; this_machine sets it to its core count."""
    assert parse_cluster("gpus: 4\nshared_cores: 2\n").shared_cores == 2
    assert parse_cluster("gpus: 4\n").shared_cores == 0
    with pytest.raises(TPCompileError, match="shared_cores must be an int >= 0"):
        Cluster(gpus=4, shared_cores=-1)
    monkeypatch.setenv("TPCOMPILE_CACHE_DIR", str(tmp_path))
    data = {"matmul_flops": 5e10, "memory_bw": 1e10, "op_overhead": 1e-5, "alpha": 2e-4, "bandwidth": 1e9,
            "nominal_flops": 1e11, "cores": 2}
    (tmp_path / "calibration.json").write_text(json.dumps({calibrate._fingerprint(): data}))
    assert calibrate.this_machine(4).shared_cores == 2
