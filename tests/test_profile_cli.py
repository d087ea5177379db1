"""`tpcompile profile MODEL -w 2 --train --json` on the bundled GPT and a Hugging Face Llama (real gloo ranks).

Slow (a launch of two rank processes each): pytest -m slow tests/test_profile_cli.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tpcompile.strategy.cluster import load_cluster

pytestmark = [pytest.mark.slow, pytest.mark.gloo]
# This machine's rates as bench/strategy_check.py measured them (README, "Choosing a layout"): the test prices
# with them instead of calibrating, which takes minutes here.
CLUSTER = """gpus: 2
gpus_per_node: 2
gpu_memory: 8GB
flops: 78GFLOPS
efficiency: 0.89
memory_bw: 5.4GB/s
intra_bw: 0.94GB/s
inter_bw: 0.94GB/s
intra_latency: 402us
inter_latency: 402us
op_overhead: 8.4us
microbatch_overhead: 8.1ms
step_overhead: 6.4ms
shared_cores: 2
optimizer_bytes: 80
optimizer_ops: 10
overlap: 0
dtype: fp32
"""


def _tpcompile(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run `python -m tpcompile ARGS` without progress lines."""
    env = {**os.environ, "TPCOMPILE_PROGRESS": "0"}
    return subprocess.run([sys.executable, "-m", "tpcompile", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _profile(tmp_path: Path, model: str, *extra: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run the command; its JSON object and the trace it wrote."""
    cluster = tmp_path / "machine.yaml"
    cluster.write_text(CLUSTER)
    trace = tmp_path / "trace.json"
    got = _tpcompile("profile", model, "-w", "2", "--train", "--json", "--steps", "4", "--cluster", str(cluster),
                     "--trace", str(trace), *extra)
    assert got.returncode == 0, got.stderr[-3000:]
    return json.loads(got.stdout), json.loads(trace.read_text())


def _check(data: dict[str, Any], trace: dict[str, Any], layers: list[str]) -> None:
    """Blocks and collectives add up to within 15% of the step; every layer has compute and priced collectives;
    the prediction and ratio sit beside each figure; the trace's collective events name their module."""
    step = data["step_ms"]
    parts = sum(b["compute_ms"] + sum(c["ms"] for c in b["collectives"]) for b in data["blocks"])
    assert 0.85 * step <= parts <= step * 1.001, (parts, step)
    assert step / 3 <= data["unprofiled_step_ms"] <= step * 3  # the profiler does not make a different step
    blocks = {b["block"]: b for b in data["blocks"]}
    assert data["predicted_step_ms"] > 0
    for layer in layers:
        b = blocks[layer]
        assert b["compute_ms"] > 0 and b["predicted_compute_ms"] > 0 and b["compute_ratio"] > 0
        tp = [c for c in b["collectives"] if c["phase"] == "forward"]
        assert len(tp) >= 2, b
        for c in b["collectives"]:
            assert c["module"].startswith(layer + ".") and c["bytes"] > 0
            assert c["predicted_ms"] > 0 and c["ratio"] == pytest.approx(c["ms"] / c["predicted_ms"], rel=1e-2)
    terms = {t["term"]: t for t in data["terms"]}
    assert terms["compute"]["predicted_ms"] > 0 and terms["tp_comm"]["predicted_ms"] > 0
    assert all(t["off"] == any(s.startswith(t["term"] + ":") for s in data["off_terms"]) for t in data["terms"])
    ops = [e for e in trace["traceEvents"] if e.get("cat") == "collective" and e["name"].startswith("tpcompile")]
    assert {e["pid"] for e in ops} == {0, 1}
    assert ops and all(e["args"]["module"] for e in ops if e["args"]["phase"] != "outside")


def test_profile_gpt_train(tmp_path: Path) -> None:
    """The bundled GPT at 2 ranks: the figures add up, and --calibrate writes a file `strategy --cluster` reads."""
    calibrated = tmp_path / "calibrated.yaml"
    data, trace = _profile(tmp_path, "gpt", "--calibrate", str(calibrated), "--png", str(tmp_path / "p.png"))
    _check(data, trace, ["transformer.h.0", "transformer.h.1"])
    fitted = load_cluster(calibrated)
    assert fitted.gpus == 2 and fitted.intra_latency > 0
    assert "# measured" in calibrated.read_text()
    plan = _tpcompile("strategy", "gpt", "--cluster", str(calibrated), "--global-batch", "2", "--json", timeout=300)
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert json.loads(plan.stdout)["tp"] in (1, 2)
    assert (tmp_path / "p.png").stat().st_size > 5000


def test_profile_hf_llama_train(tmp_path: Path) -> None:
    """A Hugging Face Llama (2 layers) at 2 ranks: the same checks on model.layers.0 and model.layers.1."""
    pytest.importorskip("transformers")
    data, trace = _profile(tmp_path, "hf:llama")
    _check(data, trace, ["model.layers.0", "model.layers.1"])
