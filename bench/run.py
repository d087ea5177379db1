"""Benchmark tpcompile against one process, hand-written Megatron TP, DTensor and _tp_transform, in one run.

Run from the repository root:  .venv/bin/python -m bench   (or python bench/run.py)
Writes bench/results/latest.json, latest.md, latency.png and compile_time.png; a smoke run (--tiny)
writes them to a temporary folder instead, so it never replaces the published results.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tpcompile import TPCompileError  # noqa: E402
from tpcompile.runtime import launch  # noqa: E402

from bench.compile_time import measure_compile_time  # noqa: E402
from bench.contenders import CONTENDERS  # noqa: E402
from bench.device import BACKENDS, choose_backend, describe_device  # noqa: E402
from bench.measure import LR, rank_main  # noqa: E402
from bench.report import render, plot_compile_time, plot_latency  # noqa: E402
from bench.workloads import WORKLOADS  # noqa: E402

FULL = dict(models=("mlp", "gpt"), specs=[("mlp", {}), ("gpt", {})], reps=40, train_reps=15, warmup=3, layers=(2, 8, 32),
            repeats=2, shape=None)
# A seconds-long run of the same code path, for the smoke test (the GPT only when asked for).
TINY = dict(models=("mlp",), specs=[("mlp", dict(width=32, hidden=64, pairs=2, batch=(2, 8))),
                   ("gpt", dict(vocab=64, block=16, layers=2, heads=4, embd=32, batch=(2, 8)))],
            reps=3, train_reps=2, warmup=1, layers=(1, 2), repeats=1,
            shape=dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=8, intermediate_size=128,
                       vocab_size=128))
# Relative: first loss against the original's (forward), and the drop from the first to the second
# loss against the original's drop (the gradient and the SGD step); more means wrong gradients.
LOSS_TOLERANCE = 1e-4
STEP_TOLERANCE = 1e-2
DIFF_TOLERANCE = 1e-4  # absolute: forward outputs must match the original this closely


def _ms(times: list[float]) -> dict[str, float]:
    """Median, quartiles and minimum of a list of seconds, in ms."""
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return {"median_ms": 1e3 * statistics.median(times), "q1_ms": 1e3 * q[0], "q3_ms": 1e3 * q[2],
            "min_ms": 1e3 * min(times)}


def _paired(a: list[float], b: list[float]) -> float:
    """Median over repetitions of a's time over b's time in the same repetition."""
    return statistics.median(x / y for x, y in zip(a, b))


def _paired_spread(a: list[float], b: list[float]) -> list[float]:
    """First and third quartile of the per-repetition ratios a / b."""
    ratios = [x / y for x, y in zip(a, b)]
    if len(ratios) < 2:
        return [ratios[0], ratios[0]]
    q = statistics.quantiles(ratios, n=4)
    return [q[0], q[2]]


def summarize_workload(per_rank: list[dict]) -> dict[str, Any]:
    """One workload's results from every rank: statuses, medians, pairwise ratios, counts."""
    out: dict[str, Any] = {}
    for name, first in per_rank[0].items():
        if "error" in first:
            out[name] = {"status": "failed", "error": first["error"]}
            continue
        row: dict[str, Any] = {"status": "ok", "param_bytes": max(r[name]["param_bytes"] for r in per_rank),
                               "setup_s": max(r[name]["setup_s"] for r in per_rank)}
        for key in ("capture_s", "passes_s", "rewrite_s", "static_collectives"):
            if key in first:
                row[key] = first[key]
        for phase in ("forward", "train"):
            res = first[phase]
            if "error" in res:
                row[phase] = {"status": "failed", "error": res["error"]}
                continue
            same = all(r[name][phase]["counts"] == res["counts"] and r[name][phase]["bytes"] == res["bytes"]
                       for r in per_rank)
            entry = {"status": "ok", "counts": res["counts"], "bytes": res["bytes"], "ranks_agree": same,
                     **_ms(res["times"]), "times_ms": [1e3 * t for t in res["times"]]}
            if phase == "forward":
                entry["max_abs_diff"] = max(r[name]["forward"]["diff"] for r in per_rank)
                if name == "tpcompile":
                    entry["tpcompile_record"] = res["tpcompile_record"]
                if entry["max_abs_diff"] > DIFF_TOLERANCE:
                    entry["status"] = "wrong output"
            else:
                (l1, l2), (r1, r2) = res["losses"], res["ref_losses"]
                rel = abs(l1 - r1) / abs(r1)
                step_rel = abs((l1 - l2) - (r1 - r2)) / abs(r1 - r2)
                entry.update(losses=res["losses"], ref_losses=res["ref_losses"], loss_rel_diff=rel,
                             step_rel_diff=step_rel)
                if rel > LOSS_TOLERANCE or step_rel > STEP_TOLERANCE:
                    entry["status"] = "wrong gradients"
            row[phase] = entry
        out[name] = row
    for phase in ("forward", "train"):
        timed = {n: r[phase]["times_ms"] for n, r in out.items() if r.get(phase, {}).get("times_ms")}
        for n, times in timed.items():
            out[n][phase]["ratio"] = {m: _paired(times, other) for m, other in timed.items()}
            out[n][phase]["ratio_quartiles"] = {m: _paired_spread(times, other) for m, other in timed.items()}
    return out


def targets(mlp: dict[str, Any], compile_time: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's acceptance checks (MLP stack; deepest shard() timing), each with its measured value."""
    tp, hand = mlp.get("tpcompile", {}), mlp.get("hand-written", {})
    ratio = tp.get("forward", {}).get("ratio", {})
    checks = [("forward ratio tpcompile / hand-written <= 1.05", ratio.get("hand-written"), 1.05),
              ("forward ratio tpcompile / DTensor <= 1.0", ratio.get("dtensor"), 1.0)]
    rows = [{"check": c, "value": v, "ok": v is not None and v <= limit} for c, v, limit in checks]
    for phase in ("forward", "train"):
        a, b = tp.get(phase, {}).get("bytes"), hand.get(phase, {}).get("bytes")
        rows.append({"check": f"{phase} bytes tpcompile == hand-written", "value": [a, b],
                     "ok": a is not None and a == b})
    deepest = compile_time["rows"][-1]
    rows.append({"check": f"passes at {deepest['layers']} layers < capture (torch.export), seconds",
                 "value": [deepest["passes_s"], deepest["capture_s"]], "ok": deepest["passes_s"] < deepest["capture_s"]})
    return rows


RESULTS = ROOT / "bench" / "results"
SMOKE_RESULTS = Path(tempfile.gettempdir()) / "tpcompile-bench-smoke"


def parser() -> argparse.ArgumentParser:
    """The command's arguments."""
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, default=None,
                    help=f"where the results go (default {RESULTS.relative_to(ROOT)}; with --tiny {SMOKE_RESULTS})")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--backend", choices=BACKENDS, default="auto",
                    help="auto: nccl (one GPU per rank) when there are enough GPUs, else gloo on the CPU")
    ap.add_argument("--tiny", action="store_true",
                    help="smoke run: tiny models, a few repetitions; checks that everything runs, times nothing "
                         "worth reading, and writes outside bench/results")
    ap.add_argument("--reps", type=int, help="timed forwards per contender")
    ap.add_argument("--train-reps", type=int, help="timed training steps per contender")
    ap.add_argument("--models", help="comma-separated subset of: " + ", ".join(WORKLOADS))
    ap.add_argument("--readme", action="store_true", help="also copy the table into README.md")
    ap.add_argument("--from-json", type=Path, help="measure nothing: redraw the outputs from a saved latest.json")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run everything, write the four outputs, print the tables."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["generate"]:  # the generation section: python -m bench generate (bench/generate.py)
        from bench.generate import main as generate_main
        return generate_main(argv[1:])
    if argv[:1] == ["gpu"]:  # the one-GPU check: python -m bench gpu (bench/gpu.py)
        from bench.gpu import main as gpu_main
        return gpu_main(argv[1:])
    ap = parser()
    args = ap.parse_args(argv)
    saved = json.loads(args.from_json.read_text()) if args.from_json is not None else None
    smoke = args.tiny or bool(saved and saved.get("tiny"))
    if smoke and args.readme:
        ap.error("--readme publishes the results in README.md; a --tiny smoke run is not one to publish")
    args.out_dir = args.out_dir or (SMOKE_RESULTS if smoke else RESULTS)
    if saved is not None:
        return write_outputs(saved, args.out_dir, args.readme)
    cfg = dict(TINY if args.tiny else FULL)
    cfg["reps"] = args.reps or cfg["reps"]
    cfg["train_reps"] = args.train_reps or cfg["train_reps"]
    models = args.models.split(",") if args.models else cfg["models"]
    unknown = sorted(set(models) - set(WORKLOADS))
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
    cfg["specs"] = [(name, kwargs) for name, kwargs in cfg["specs"] if name in models]
    try:
        backend = choose_backend(args.backend, args.world_size)
    except TPCompileError as e:
        print(f"bench: error: {e}", file=sys.stderr)
        return 2
    # torch's own deprecation inside copy.deepcopy of its tree specs (rank processes filter it in rank_main)
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning)
    wall = time.perf_counter()
    load_start = list(os.getloadavg())  # other work on the machine: the report states it
    timing = (cfg["layers"], 8, cfg["repeats"], cfg["shape"])
    # The tiny run times nothing that matters, so it overlaps the two parts; the full run keeps the
    # rank processes alone on the machine.
    with ThreadPoolExecutor(1) as pool:
        early = pool.submit(measure_compile_time, *timing) if args.tiny else None
        ranks = launch(args.world_size, rank_main, args.world_size, cfg["specs"], cfg["reps"],
                       cfg["train_reps"], cfg["warmup"], backend=backend, timeout=540)
        compile_time = early.result() if early is not None else measure_compile_time(*timing)
    workloads = {}
    for name, kwargs in cfg["specs"]:
        wl = WORKLOADS[name](**kwargs)
        workloads[name] = {"describe": wl.describe, "config": wl.config, "plan": wl.plan,
                           "contenders": summarize_workload([r[name] for r in ranks])}
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
        "backend": backend, "device": describe_device(backend, args.world_size), "world_size": args.world_size,
        "threads_per_rank": 1, "tiny": args.tiny,
        "reps": cfg["reps"], "train_reps": cfg["train_reps"], "warmup": cfg["warmup"], "lr": LR,
        "contenders": list(CONTENDERS), "workloads": workloads, "compile_time": compile_time,
        "targets": targets(workloads["mlp"]["contenders"], compile_time) if "mlp" in workloads else [],
        "cpus": os.cpu_count(), "loadavg_start": load_start, "loadavg_end": list(os.getloadavg()),
    }
    result["wall_s"] = time.perf_counter() - wall
    return write_outputs(result, args.out_dir, args.readme)


def write_outputs(result: dict[str, Any], out_dir: Path, readme: bool) -> int:
    """latest.json, latest.md and both figures in out_dir; the README too when asked."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_latency(result, out_dir / "latency.png")
    plot_compile_time(result, out_dir / "compile_time.png")
    (out_dir / "latest.json").write_text(json.dumps(result, indent=1) + "\n")
    text = render(result)
    (out_dir / "latest.md").write_text(text)
    print(terminal_text(text))
    kind = "smoke run (--tiny): numbers not comparable with a full run; " if result.get("tiny") else ""
    print(f"\n{kind}wrote {out_dir}/latest.json, latest.md, latency.png, compile_time.png "
          f"(measured in {result['wall_s']:.0f} s)")
    if readme:
        from bench.update_readme import main as update_readme
        return update_readme()
    return 0


def terminal_text(report: str) -> str:
    """The report's headings, notes and tables for the terminal: each table under the name of what it measured,
    without the method section and picture links."""
    keep = []
    for line in report.split("## How it is measured")[0].splitlines():
        if line.startswith("!["):
            continue
        if line.startswith("#") and keep:
            keep.append("")
        keep.append(line.lstrip("# ") if line.startswith("#") else line)
    return "\n".join(line for k, line in enumerate(keep) if line or (k and keep[k - 1])).strip()


if __name__ == "__main__":
    sys.exit(main())
