"""The one-GPU check (python -m bench gpu): its dry run on the CPU runs every part, and a part that fails or
overruns its budget is reported without losing the others."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from bench.gpu import BUDGETS, render, run_part  # noqa: E402

PARTS = ["environment", "bandwidth", "rank_graph", "train_bf16", "decode", "compile", "forward_ratios"]


def _dry(tmp_path: Path, *extra: str) -> dict:
    """Run `python -m bench gpu --dry` into tmp_path; its JSON."""
    proc = subprocess.run([sys.executable, "-m", "bench", "gpu", "--dry", "--out-dir", str(tmp_path), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=400,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "decode (budget" in proc.stdout  # progress is printed as it goes
    assert (tmp_path / "gpu.md").read_text().count("| ok |") >= 6
    return json.loads((tmp_path / "gpu.json").read_text())


def test_dry_run_reports_every_part_ok(tmp_path: Path) -> None:
    """The dry run (compile skipped) exits 0; every other part is ok and reports its numbers."""
    result = _dry(tmp_path, "--skip", "compile")
    parts = result["parts"]
    assert list(parts) == PARTS == list(BUDGETS)
    assert parts["compile"]["status"] == "skipped"
    assert [n for n, p in parts.items() if p["status"] != "ok"] == ["compile"]
    assert result["meta"]["dry"] is True and parts["environment"]["world_size"] == 1
    assert parts["bandwidth"]["bytes_per_s"] > 0 and parts["bandwidth"]["nominal_bytes_per_s"] == 4.8e12
    assert parts["rank_graph"]["max_abs_diff"] < 1e-3
    assert len(parts["train_bf16"]["parallelize_train"]["losses"]) == 3
    decode = parts["decode"]
    assert decode["graphs_equal_eager"] and decode["tpcompile"]["decode_tokens_per_s"] > 0
    assert set(decode["roofline"]) >= {"bytes_per_token", "tokens_per_s", "fraction", "fraction_of_nominal"}
    assert decode["roofline"]["bytes_per_token"]["weights"] > 0
    for workload in ("mlp", "gpt"):
        assert set(parts["forward_ratios"][workload]["ratio_to_hand_written"]) == {
            "one process", "hand-written", "tpcompile", "tpcompile, comm=False"}


@pytest.mark.slow
def test_dry_run_compiles_a_rank_graph_with_inductor(tmp_path: Path) -> None:
    """The dry run with inductor (a C++ compile on the CPU, about a minute): the compiled rank graph equals eager."""
    part = _dry(tmp_path)["parts"]["compile"]
    assert part["status"] == "ok" and part["max_abs_diff"] < 1e-3 and part["next_step_s"] > 0


def test_a_failing_or_overrunning_part_is_reported_and_the_report_renders() -> None:
    """A part that raises is 'failed' with its error and place, one past its budget 'timed out' within about
    the budget; the report renders both."""
    def broken(setup: object) -> dict:
        raise RuntimeError("no device")

    def slow(setup: object) -> dict:
        time.sleep(30)
        return {"ok": True}

    failed = run_part("bandwidth", broken, None, 10)
    start = time.perf_counter()
    late = run_part("decode", slow, None, 1)
    assert time.perf_counter() - start < 5
    assert failed["status"] == "failed" and "RuntimeError: no device" in failed["error"] and "test_gpu_check" in \
        failed["where"]
    assert late["status"] == "timed out" and "budget of 1 s" in late["error"]
    meta = {"command": "python -m bench gpu", "date": "today", "wall_s": 2.0, "deadline_s": 450.0, "dry": False}
    text = render({"meta": meta, "parts": {"bandwidth": failed, "decode": late}})
    assert "| bandwidth | failed |" in text and "| decode | timed out |" in text
