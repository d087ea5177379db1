"""The profile report beside a prediction: ratios, the terms named when off, the text, the chart, --calibrate."""
from __future__ import annotations

from pathlib import Path

import pytest

from tpcompile.report.profile_predict import Prediction, calibrated, cluster_yaml
from tpcompile.report.profile_report import build_report
from tpcompile.runtime.profiler import RankProfile
from tpcompile.runtime.profiler_events import Call, StepRecord
from tpcompile.strategy import comm
from tpcompile.strategy.cluster import Cluster, load_cluster

ALPHA, BW = 400e-6, 1e9  # the link the synthetic collectives ran on


def _ring_ms(nbytes: int) -> float:
    """A 2-rank ring all-reduce of nbytes on the test link, in ms."""
    return comm.all_reduce(nbytes, 2, BW, ALPHA).seconds * 1e3


def _ranks() -> list[RankProfile]:
    """Two ranks of one step: block h.0 (2 ms compute) with all-reduces of 4 KiB and 4 MiB at the ring's cost,
    the optimizer region (1 ms), 0.5 ms of other."""
    sizes = (4096, 4 << 20)
    calls = [Call("all_reduce", "forward", f"h.0.m{i}", f"ar_{i}", "h.0", n, _ring_ms(n), 1.0 + i)
             for i, n in enumerate(sizes)]
    step = 2.0 + 1.0 + 0.5 + sum(c.ms for c in calls)
    rec = StepRecord(step, 0.5, {"h.0": 2.0}, {"optimizer": 1.0}, calls)
    return [RankProfile(r, (0, 1), [rec], modules={"h.0": ["h.0"]}) for r in (0, 1)]


def _prediction(compute_ms: float) -> Prediction:
    """A prediction on the test link with the given compute and the measured optimizer and overhead."""
    cl = Cluster(gpus=2, gpus_per_node=2, intra_bw=BW, intra_latency=ALPHA, inter_bw=BW, inter_latency=ALPHA)
    comm_ms = sum(_ring_ms(n) for n in (4096, 4 << 20))
    terms = {"compute": compute_ms, "tp_comm": comm_ms, "optimizer": 1.0, "overhead": 0.5}
    return Prediction(cl, 2, sum(terms.values()), terms, {"h.0": (compute_ms, comm_ms)})


def test_prediction_sits_beside_each_figure_and_off_terms_are_named() -> None:
    """Collectives priced at their bytes match (ratio 1); compute predicted at half is named off by 2x."""
    data = build_report(_ranks(), _prediction(1.0), model="m", train=True).data
    (h0,) = [b for b in data["blocks"] if b["block"] == "h.0"]
    assert [c["ratio"] for c in h0["collectives"]] == [pytest.approx(1.0), pytest.approx(1.0)]
    assert h0["compute_ratio"] == pytest.approx(2.0)
    assert [t["term"] for t in data["terms"] if t["off"]] == ["compute"]
    assert data["off_terms"][0].startswith("compute: measured 2.00 ms, predicted 1.00 ms (2.00x)")
    assert data["accounted_ms"] + data["other_ms"] == pytest.approx(data["step_ms"])


def test_table_and_chart(tmp_path: Path) -> None:
    """The text names every block, collective and term; the PNG is a real image file."""
    rep = build_report(_ranks(), _prediction(1.0), model="m", train=True)
    text = rep.table()
    for words in ("h.0 compute", "all_reduce (forward) h.0.m1", "optimizer (region of the loop)",
                  "off by more than 25%: compute"):
        assert words in text
    pytest.importorskip("matplotlib")
    png = rep.save_png(tmp_path / "p.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_calibrate_recovers_the_link_and_writes_a_cluster_file(tmp_path: Path) -> None:
    """The fit of latency and bandwidth to collectives of two sizes gives back the link they ran on; the file it
    writes is a cluster file that load_cluster reads with those values."""
    pred = _prediction(1.0)
    pred.cluster = Cluster(gpus=2, gpus_per_node=2, intra_bw=5e9, intra_latency=1e-5, inter_bw=5e9,
                           inter_latency=1e-5)  # the prediction's link is wrong: the fit must not start from it
    data = build_report(_ranks(), pred, model="m", train=True).data
    fitted, fields = calibrated(data, pred)
    assert fitted.intra_latency == pytest.approx(ALPHA, rel=1e-3)
    assert fitted.intra_bw == pytest.approx(BW, rel=1e-3)
    assert fitted.matmul_rate == pytest.approx(pred.cluster.matmul_rate / 2.0)  # compute measured at 2x
    assert {"intra_latency", "intra_bw", "efficiency", "step_overhead"} <= set(fields)
    # the optimizer was measured as predicted: its time stays, though the memory rate it reads was halved
    before = pred.cluster.optimizer_bytes / pred.cluster.memory_bw
    assert fitted.optimizer_bytes / fitted.memory_bw == pytest.approx(before)
    path = tmp_path / "cluster.yaml"
    path.write_text(cluster_yaml(fitted, fields, "a test"))
    back = load_cluster(path)
    assert back.intra_bw == pytest.approx(fitted.intra_bw, rel=1e-5)
    assert back.intra_latency == pytest.approx(ALPHA, rel=1e-3) and back.gpus == 2


def test_cli_refuses_calibrate_without_prediction(capsys: pytest.CaptureFixture[str]) -> None:
    """--calibrate with --no-predict is one error line (exit 2) before any rank starts."""
    from tpcompile.cli.main import main
    assert main(["profile", "gpt", "--no-predict", "--calibrate", "c.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --calibrate compares the profile with the cost model's prediction") and \
        err.count("\n") == 1
