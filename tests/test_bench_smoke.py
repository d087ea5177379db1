"""The benchmark command runs end to end in a tiny configuration; its hand-written baselines are exact."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tpcompile import TPCompileError
from tpcompile.models import GPT, GPTConfig
from tpcompile.runtime import launch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from bench.device import choose_backend, describe_device  # noqa: E402
from bench.handwritten_tp import TPGPT  # noqa: E402
from bench.run import main as bench_main  # noqa: E402
from bench.run import summarize_workload

pytestmark = pytest.mark.gloo

TINY = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
CONTENDERS = ("single", "hand-written", "dtensor", "tp_transform", "tpcompile")


def _tiny(**kw: object) -> GPT:
    """The tiny GPT with fixed weights."""
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**TINY, **kw})).eval()


VARIANTS = {"fused-tied": {}, "separate-untied-manual": dict(fused_qkv=False, tie_weights=False, attention="manual")}


def _hand_rank(rank: int, cases: dict, idx: torch.Tensor) -> dict:
    """Per variant: this rank's hand-written TP logits, collective counts and parameter bytes."""
    out = {}
    for name, (cfg, state) in cases.items():
        model = GPT(GPTConfig(**cfg)).eval()
        model.load_state_dict(state)
        tp = TPGPT(model, rank, 2)
        with torch.no_grad():
            logits = tp(idx)
        out[name] = (logits, tp.comm.counts(), tp.parameter_bytes())
    return out


@pytest.mark.slow
def test_handwritten_tp_equals_unsharded() -> None:
    """At world size 2 on gloo, both ranks' logits equal the unsharded model's within 1e-5."""
    idx = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    models = {name: _tiny(**kw) for name, kw in VARIANTS.items()}
    cases = {name: ({**TINY, **VARIANTS[name]}, m.state_dict()) for name, m in models.items()}
    results = launch(2, _hand_rank, cases, idx, timeout=60)
    for name, model in models.items():
        with torch.no_grad():
            ref = model(idx)
        full = sum(p.numel() * p.element_size() for p in model.parameters())
        for rank, per_variant in enumerate(results):
            out, counts, nbytes = per_variant[name]
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=0, msg=lambda m: f"{name} rank {rank}: {m}")
            assert counts == {"all_reduce": 1 + 2 * TINY["n_layer"], "all_gather": 1}
            assert nbytes < full


def _check_rows(rows: dict, reps: int) -> None:
    """Every contender but _tp_transform ran, exactly; tpcompile moves the hand-written bytes."""
    assert tuple(rows) == CONTENDERS
    for name in ("single", "hand-written", "dtensor", "tpcompile"):
        fwd, train = rows[name]["forward"], rows[name]["train"]
        assert fwd["status"] == "ok" and train["status"] == "ok", (name, fwd, train)
        assert fwd["max_abs_diff"] <= 1e-4 and train["loss_rel_diff"] <= 1e-4 and train["step_rel_diff"] <= 1e-2
        assert 0 < fwd["min_ms"] <= fwd["median_ms"] and 0 < train["median_ms"]
        assert len(fwd["times_ms"]) == reps and fwd["ranks_agree"] and train["ranks_agree"]
        assert rows[name]["param_bytes"] > 0
    assert rows["single"]["forward"]["counts"] == {} and rows["single"]["forward"]["bytes"] == 0
    for phase in ("forward", "train"):
        assert rows["tpcompile"][phase]["counts"] == rows["hand-written"][phase]["counts"]
        assert rows["tpcompile"][phase]["bytes"] == rows["hand-written"][phase]["bytes"] > 0
    # The dispatch-mode count agrees with tpcompile's own record of its collectives.
    record = rows["tpcompile"]["forward"]["tpcompile_record"]
    assert record["bytes"] == rows["tpcompile"]["forward"]["bytes"]
    assert sum(record["counts"].values()) == sum(rows["tpcompile"]["forward"]["counts"].values())
    assert rows["tpcompile"]["param_bytes"] == rows["hand-written"]["param_bytes"] < rows["single"]["param_bytes"]
    ratio = rows["tpcompile"]["forward"]["ratio"]
    assert ratio["tpcompile"] == 1.0 and ratio["hand-written"] > 0


def test_bench_command_tiny(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    """`python -m bench --tiny` writes JSON, markdown and both PNGs holding real, consistent measurements,
    labelled a smoke run, with tables named on stdout and no warnings of torch's on stderr."""
    assert bench_main(["--tiny", "--out-dir", str(tmp_path)]) == 0
    out, err = capfd.readouterr()  # the rank processes write to the same file descriptors
    assert "unwaited collective" not in err and "LeafSpec" not in err, err
    assert "\nMLP stack\n" in out and "smoke run (--tiny)" in out
    assert "| NO |" not in out and "| not judged |" in out
    res = json.loads((tmp_path / "latest.json").read_text())
    mlp = res["workloads"]["mlp"]["contenders"]
    _check_rows(mlp, res["reps"])
    # Two column/row pairs: one all-reduce each forward; backward adds one per pair but the first.
    assert mlp["hand-written"]["forward"]["counts"] == {"all_reduce": 2}
    assert mlp["hand-written"]["train"]["counts"] == {"all_reduce": 3}
    # Identical bytes (forward and step); the passes take less time than torch.export.
    assert [t["ok"] for t in res["targets"]][2:] == [True, True, True]
    ct = res["compile_time"]["rows"]
    assert [r["layers"] for r in ct] == [1, 2] and all(r["capture_s"] > 0 and r["passes_s"] > 0 for r in ct)
    assert ct[1]["nodes"] > ct[0]["nodes"] and ct[1]["collectives"] > ct[0]["collectives"]
    text = (tmp_path / "latest.md").read_text()
    assert text.startswith("# tpcompile against other tensor-parallel methods (smoke run)\n")
    assert "Smoke run (`--tiny`)" in text and "python -m bench --tiny" in text
    assert res["backend"] == "gloo" and res["device"] == "CPU, gloo" and "world size 2 (CPU, gloo)" in text
    tp_row = next(line for line in text.splitlines() if line.startswith("| tpcompile |"))
    assert f"| {mlp['tpcompile']['forward']['median_ms']:.1f} |" in tp_row
    assert "](latency.png)" in text and "](compile_time.png)" in text
    for png in ("latency.png", "compile_time.png"):
        data = (tmp_path / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


@pytest.mark.slow
def test_bench_command_tiny_gpt(tmp_path: Path) -> None:
    """The GPT rows of the tiny run: every contender but _tp_transform exact, tpcompile's bytes Megatron's."""
    assert bench_main(["--tiny", "--models", "gpt", "--out-dir", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "latest.json").read_text())
    gpt = res["workloads"]["gpt"]["contenders"]
    _check_rows(gpt, res["reps"])
    # Per layer two all-reduces forward, plus the vocabulary embedding's; the logits all-gathered.
    assert gpt["hand-written"]["forward"]["counts"] == {"all_reduce": 5, "all_gather": 1}
    assert res["targets"] == []


def test_smoke_runs_write_outside_the_published_results(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    """A smoke run's results go to a temporary folder, never bench/results, and never into the README."""
    import bench.run as run

    written = []
    monkeypatch.setattr(run, "write_outputs", lambda res, out_dir, readme: written.append((out_dir, readme)) or 0)
    for tiny in (True, False):
        saved = tmp_path / f"tiny{tiny}.json"
        saved.write_text(json.dumps({"tiny": tiny}))
        assert bench_main(["--from-json", str(saved)]) == 0
    assert written == [(run.SMOKE_RESULTS, False), (ROOT / "bench" / "results", False)]
    assert not run.SMOKE_RESULTS.is_relative_to(ROOT)
    with pytest.raises(SystemExit) as exc:
        bench_main(["--tiny", "--readme"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m bench ") and "a --tiny smoke run is not one to publish" in err


def test_wrong_gradients_are_flagged() -> None:
    """A training step whose loss drop differs from the original's by over 1% is marked, not timed as ok."""
    def rank(losses: list[float]) -> dict:
        phase = {"counts": {}, "bytes": 0, "times": [0.01, 0.02, 0.03]}
        return {"x": {"param_bytes": 1, "setup_s": 0.0,
                      "forward": {**phase, "diff": 0.0},
                      "train": {**phase, "losses": losses, "ref_losses": [1.0, 0.9], "loss_diff": 0.0}}}
    ok = summarize_workload([rank([1.0, 0.9005])])["x"]["train"]
    wrong = summarize_workload([rank([1.0, 0.95])])["x"]["train"]
    assert ok["status"] == "ok" and ok["step_rel_diff"] < 1e-2
    assert wrong["status"] == "wrong gradients" and abs(wrong["step_rel_diff"] - 0.5) < 1e-9


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """torch.cuda reports `count` devices (none: unavailable), each an 'NVIDIA H200'."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "NVIDIA H200")


def test_backend_choice(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """auto is gloo without CUDA or with too few GPUs, nccl with one per rank; nccl without them is one clear error."""
    _fake_cuda(monkeypatch, 0)
    assert choose_backend("auto", 2) == "gloo" and choose_backend("gloo", 2) == "gloo"
    assert describe_device("gloo", 2) == "CPU, gloo"
    with pytest.raises(TPCompileError, match=r"needs 2 CUDA devices .* found 0 .*--backend gloo"):
        choose_backend("nccl", 2)
    # The command turns it into one line on stderr and exit status 2, before starting any rank.
    assert bench_main(["--tiny", "--backend", "nccl"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "found 0" in err and "--backend gloo" in err
    _fake_cuda(monkeypatch, 1)
    assert choose_backend("auto", 2) == "gloo"
    with pytest.raises(TPCompileError, match="found 1"):
        choose_backend("nccl", 2)
    _fake_cuda(monkeypatch, 2)
    assert choose_backend("auto", 2) == "nccl" and choose_backend("nccl", 2) == "nccl"
    assert choose_backend("gloo", 2) == "gloo" and choose_backend("auto", 4) == "gloo"
    assert describe_device("nccl", 2) == "2 x NVIDIA H200 on nccl"


def test_median_interval_brackets_the_median_and_narrows_with_samples() -> None:
    """The comm bench's bootstrap interval: a point for constant data, around the median, narrower with more."""
    import random
    import statistics

    from bench.comm_ratio import median_interval
    assert median_interval([1.0] * 9) == (1.0, 1.0)
    rng = random.Random(3)
    few = [rng.gauss(1.0, 0.1) for _ in range(15)]
    many = [rng.gauss(1.0, 0.1) for _ in range(600)]
    (lo_f, hi_f), (lo_m, hi_m) = median_interval(few), median_interval(many)
    assert lo_f <= statistics.median(few) <= hi_f and lo_m <= statistics.median(many) <= hi_m
    assert hi_m - lo_m < (hi_f - lo_f) / 2
    assert lo_m < 1.0 < hi_m
