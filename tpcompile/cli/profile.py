"""`tpcompile profile MODEL -w N`: run every rank as a real process and show where each step's time and bytes go."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tpcompile.cli.common import add_model_args, load, load_plan, parse_config, world_size
from tpcompile.cli.demo import check_backend
from tpcompile.cli.progress import note, step
from tpcompile.errors import TPCompileError


def add_parser(sub: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    """Register the subcommand."""
    p = sub.add_parser(
        "profile", parents=[parent], help="profile every rank: per block its compute and collectives, vs predicted",
        description="Shard MODEL, run every rank as a real torch.distributed process (gloo, or nccl) for --warmup "
                    "and then --steps steps under torch.profiler, and print per block its compute time and each "
                    "collective's time, bytes and waiting on other ranks, the cost model's prediction beside every "
                    "figure with the ratio, and the cost-model terms off by more than 25%. Figures are means per "
                    "step over the steps and the ranks.",
        epilog="docs/cli.md (profile) explains each figure; docs/troubleshooting.md says which one shows which "
               "problem.")
    add_model_args(p, default_model="gpt")
    p.add_argument("--train", action="store_true", help="profile training steps: forward, a stand-in loss (the mean "
                                                        "square of the outputs), backward, AdamW (default: forward)")
    p.add_argument("--steps", type=world_size, default=5, metavar="K", help="profiled steps per rank (default 5)")
    p.add_argument("--warmup", type=int, default=2, metavar="W", help="unprofiled steps before them (default 2)")
    p.add_argument("--trace", metavar="FILE", help="write a Chrome / Perfetto trace of every rank (one process each)")
    p.add_argument("--png", metavar="FILE", help="write a chart: stacked bars per block (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--cluster", metavar="FILE", help="predict on this cluster file (default: this machine's "
                                                     "calibration, measured once and cached)")
    p.add_argument("--no-predict", action="store_true", help="measure only; no cost-model prediction")
    p.add_argument("--calibrate", metavar="FILE", help="write the cluster fields this profile measured (latency, "
                                                       "bandwidth, compute rates, optimizer and step overheads) as a "
                                                       "cluster file for tpcompile strategy --cluster FILE")
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"), help="torch.distributed backend (default "
                                                                                "gloo, CPU)")
    p.set_defaults(func=run)


def _launch(ns: argparse.Namespace, loaded: Any, layers: list[str]) -> list[dict]:
    """Every rank's result dict (its RankProfile and bare step time)."""
    from tpcompile.runtime import launch
    from tpcompile.runtime.profiler_run import RunSpec, profile_rank
    spec = RunSpec(ns.model, parse_config(ns.config), loaded.model.state_dict(), loaded.args, loaded.kwargs,
                   ns.world_size, load_plan(ns), ns.sequence_parallel, ns.train, ns.steps, max(ns.warmup, 0),
                   layers, ns.backend, bool(ns.trace))
    results = launch(ns.world_size, profile_rank, spec, backend=ns.backend, timeout=600.0)
    for res in results:
        if "error" in res:
            raise TPCompileError(res["error"])
    return results


def run(ns: argparse.Namespace) -> int:
    """Profile and print the report (or its JSON); write the trace, chart and cluster file asked for."""
    from tpcompile.report.profile_predict import calibrated, cluster_yaml, default_cluster, predict
    from tpcompile.report.profile_report import build_report
    from tpcompile.strategy.profile import find_layers
    ws = ns.world_size
    check_backend(ns.backend, ws)
    if ns.calibrate and ns.no_predict:
        raise TPCompileError("--calibrate compares the profile with the cost model's prediction; leave out "
                             "--no-predict")
    loaded = load(ns)
    cluster, source = None, ""
    if not ns.no_predict:  # before the ranks run: a first calibration of this machine must not run beside them
        with step("reading this machine's rates for the cost model (measured once, about a minute, then cached)"):
            cluster, source = default_cluster(ws, ns.backend, ns.cluster)
    layers = find_layers(loaded.model)  # the planner's blocks, so each sits beside its prediction
    with step(f"running {ws} {ns.backend} ranks of {loaded.name}: {max(ns.warmup, 0)} warm-up and {ns.steps} "
              f"profiled {'training' if ns.train else 'forward'} steps"):
        results = _launch(ns, loaded, layers)
    prediction = None
    if cluster is not None:
        with step("pricing the same steps with the cost model"):
            prediction = predict(loaded.model, loaded.args, loaded.kwargs, ws, training=ns.train, cluster=cluster)
    ranks = [r["profile"] for r in results]
    bare = sum(r["bare_ms"] for r in results) / len(results)
    report = build_report(ranks, prediction, model=loaded.name, world_size=ws, train=ns.train,
                          steps_profiled=ns.steps, unprofiled_step_ms=round(bare, 4), backend=ns.backend,
                          predicted_on=source or None)
    if ns.trace:
        from tpcompile.report.profile_trace import chrome_trace
        Path(ns.trace).write_text(json.dumps(chrome_trace(ranks)))
        note(f"wrote the trace of {ws} ranks to {ns.trace}")
    if ns.png:
        report.save_png(ns.png)
        note(f"wrote the chart to {ns.png}")
    if ns.calibrate and prediction is not None:
        fitted, fields = calibrated(report.data, prediction)
        Path(ns.calibrate).write_text(cluster_yaml(fitted, fields, f"tpcompile profile {ns.model} -w {ws}"))
        note(f"wrote the measured cluster to {ns.calibrate} (tpcompile strategy MODEL --cluster {ns.calibrate} ...)")
    print(report.to_json() if ns.json else report.table(), end="\n" if ns.json else "")
    return 0
