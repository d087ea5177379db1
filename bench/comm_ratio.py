"""`python -m bench.comm_ratio [--runs R] [--reps N] [--iters K] [--compile]`: tpcompile's communication
passes against hand-written Megatron at world size 2 on gloo, as ratios measured in R runs.

Cases: the MLP stack and the GPT of bench/workloads.py in forward (no grad), and the training step
(forward, loss, backward) of the parallel-block model of bench/parallel_block.py. Contenders on each
rank: the hand-written split, tpcompile with its default passes (`comm=None`), with
`comm=CommOptions(asynchronous=True)` and without the communication passes (`comm=False`). Each
repetition times every contender for K iterations (order rotated per repetition, both ranks started
together by a barrier, the slower rank's time kept); the ratio to hand-written is taken per repetition
and the median, a 95% bootstrap interval of the median (so a reader can tell a difference from the
machine's noise), min and max are reported per run; each run is a fresh launch of both ranks, and
the table ends with the median of the runs' medians and the interval of all runs' ratios pooled.
Outputs are checked against the hand-written ones before timing.

`--compile` instead times torch.compile (inductor) of a lowered rank graph of a 1-block GPT, forward
and backward, at world size 2 on gloo. Results go to bench/results/comm*.json and, between markers,
into docs/communication.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import statistics
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

import tpcompile
from tpcompile.runtime.launch import launch

from bench.handwritten_mlp import TPMLPStack
from bench.handwritten_tp import TPGPT
from bench.parallel_block import ParallelBlockNet, TPParallelBlockNet
from bench.workloads import gpt_workload, mlp_workload

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "communication.md"
# contender -> shard()'s comm= (hand-written has none)
COMMS = {"hand-written": None, "tpcompile, default comm (comm=None)": None,
         "tpcompile, comm=CommOptions(asynchronous=True)": tpcompile.CommOptions(asynchronous=True),
         "tpcompile, comm=False": False}
CONTENDERS = tuple(COMMS)


def _case(name: str) -> tuple[torch.nn.Module, tuple, Callable, type, bool, str]:
    """(model, inputs, loss, hand-written class, training?, description) of a case."""
    if name in ("mlp forward", "gpt forward"):
        wl = mlp_workload() if name.startswith("mlp") else gpt_workload()
        hand = TPMLPStack if name.startswith("mlp") else TPGPT
        return wl.build(), wl.inputs(), wl.loss, hand, False, wl.describe
    torch.manual_seed(0)
    model = ParallelBlockNet().train()
    x = torch.randn(8, 128, 256, generator=torch.Generator().manual_seed(1))
    return (model, (x,), lambda out, _i: (out - 1.0).square().mean(), TPParallelBlockNet, True,
            "`ParallelBlockNet(d=256, heads=8, hidden=1024, layers=4)`, input (8, 128, 256), loss mean((out - 1)**2)")


CASES = ("mlp forward", "gpt forward", "parallel-block training step")


def _step(module: torch.nn.Module, inputs: tuple, loss: Callable, train: bool) -> Callable[[], Any]:
    if not train:
        def forward() -> Any:
            with torch.no_grad():
                return module(*inputs)
        return forward

    def train_step() -> Any:
        for p in module.parameters():
            p.grad = None
        out = module(*inputs)
        loss(out, inputs).backward()
        return out
    return train_step


def _slowest(t: float) -> float:
    flag = torch.tensor([t], dtype=torch.float64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return float(flag)


def _rank(rank: int, reps: int, iters: int) -> dict:
    torch.set_num_threads(1)  # two ranks on a shared CPU: one core each
    results = {}
    for name in CASES:
        model, inputs, loss, hand_cls, train, describe = _case(name)
        modules = {"hand-written": hand_cls(model, rank, 2)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tpcompile.TPCompileWarning)
            for k in CONTENDERS[1:]:
                modules[k] = tpcompile.shard(copy.deepcopy(model), 2, example_inputs=inputs, comm=COMMS[k]).rank(rank)
        steps = {k: _step(m, inputs, loss, train) for k, m in modules.items()}
        ref = steps["hand-written"]().detach()
        diffs = {k: float((s().detach() - ref).abs().max()) for k, s in steps.items()}
        for s in steps.values():  # warm-up
            s()
        times: dict[str, list[float]] = {k: [] for k in steps}
        for rep in range(reps):
            order = CONTENDERS[rep % len(CONTENDERS):] + CONTENDERS[:rep % len(CONTENDERS)]
            for k in order:
                dist.barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    steps[k]()
                times[k].append(_slowest((time.perf_counter() - start) / iters))
        results[name] = {"times": times, "max_diff_vs_hand_written": diffs, "describe": describe}
    return results


def median_interval(values: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the median of values (seeded: the same data give the same interval)."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return meds[int(0.025 * resamples)], meds[int(0.975 * resamples) - 1]


def _ratios(times: dict[str, list[float]], k: str) -> list[float]:
    """Contender k's time over hand-written's, per repetition, sorted."""
    return sorted(t / h for t, h in zip(times[k], times["hand-written"]))


def _summary(times: dict[str, list[float]]) -> dict:
    out = {}
    for k in CONTENDERS[1:]:
        ratios = _ratios(times, k)
        out[k] = {"median": statistics.median(ratios), "ci95": median_interval(ratios),
                  "min": ratios[0], "max": ratios[-1]}
    out["hand-written ms"] = 1e3 * statistics.median(times["hand-written"])
    return out


def _pooled(runs: list[dict], name: str) -> dict:
    """Across runs: the median of the runs' medians, and median and interval of every run's ratios pooled."""
    out = {}
    for k in CONTENDERS[1:]:
        ratios = sorted(x for run in runs for x in _ratios(run[name]["times"], k))
        out[k] = {"median_of_runs": statistics.median(statistics.median(_ratios(run[name]["times"], k))
                                                      for run in runs),
                  "median": statistics.median(ratios), "ci95": median_interval(ratios),
                  "min": ratios[0], "max": ratios[-1]}
    out["hand-written ms"] = statistics.median(1e3 * statistics.median(run[name]["times"]["hand-written"])
                                               for run in runs)
    return out


def _cell(s: dict) -> str:
    return f"{s['median']:.3f} [{s['ci95'][0]:.3f}-{s['ci95'][1]:.3f}] ({s['min']:.3f}-{s['max']:.3f})"


def ratio_table(runs: list[dict], reps: int, iters: int, loads: list[tuple[float, float]]) -> list[str]:
    """The markdown the doc keeps: one row per case and run, then each case over all runs."""
    heads = " | ".join(k for k in CONTENDERS[1:])
    lines = [f"{len(runs)} runs (each a fresh launch) of {reps} repetitions of {iters} iterations, world size 2, "
             f"gloo, one thread per rank; time / hand-written time per repetition: median [95% bootstrap "
             f"interval of the median] (min-max). The machine's 1-minute load average ({os.cpu_count()} cores) "
             f"before and after each run: " + ", ".join(f"{a:.1f}/{b:.1f}" for a, b in loads) + ".", "",
             f"| case | run | hand-written (ms) | {heads} | max output diff |",
             "|---|---|---|" + "---|" * (len(CONTENDERS) - 1) + "---|"]
    for name in CASES:
        for i, run in enumerate(runs):
            s, diff = _summary(run[name]["times"]), max(run[name]["max_diff_vs_hand_written"].values())
            cells = " | ".join(_cell(s[k]) for k in CONTENDERS[1:])
            lines.append(f"| {name} | {i + 1} | {s['hand-written ms']:.2f} | {cells} | {diff:.1e} |")
        p = _pooled(runs, name)
        cells = " | ".join(f"**{p[k]['median_of_runs']:.3f}**; pooled {_cell(p[k])}" for k in CONTENDERS[1:])
        lines.append(f"| {name} | median of the {len(runs)} runs' medians; all runs pooled | "
                     f"{p['hand-written ms']:.2f} | {cells} | |")
    return lines + [""] + [f"- {name}: {runs[0][name]['describe']}" for name in CASES]


def _compile_rank(rank: int) -> dict:
    """Inductor compile of this rank's lowered 1-block GPT graph: first forward+backward, then a step.

    Inductor's on-disk caches point at a fresh folder, so the first step compiles from nothing."""
    import tempfile

    from tpcompile.models.gpt import GPT, GPTConfig
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"tpcompile-inductor-{rank}-")
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1)).train()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tpcompile.TPCompileWarning)
        gm = tpcompile.shard(model, 2, example_inputs=(ids,), sequence_parallel=True,
                             comm=tpcompile.CommOptions(lower_c10d=True)).rank(rank)
    compiled = torch.compile(gm, backend="inductor")

    def step() -> float:
        start = time.perf_counter()
        compiled(ids).float().pow(2).mean().backward()
        return time.perf_counter() - start
    first = step()
    return {"first_step_s": first, "next_step_s": step()}


def _write_doc(marker: str, text: str) -> None:
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    doc = DOC.read_text()
    head, rest = doc.split(begin, 1)
    DOC.write_text(head + begin + "\n" + text + "\n" + end + rest.split(end, 1)[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="fresh launches, each timing every contender")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args(argv)
    out_dir = ROOT / "bench" / "results"
    if args.compile:
        res = launch(2, _compile_rank, timeout=900)
        (out_dir / "comm_compile.json").write_text(json.dumps(res, indent=1) + "\n")
        lines = ["| rank | torch.compile + first forward+backward, empty inductor cache (s) | next step (s) |",
                 "|---|---|---|"]
        lines += [f"| {r} | {x['first_step_s']:.1f} | {x['next_step_s']:.3f} |" for r, x in enumerate(res)]
        _write_doc("comm-compile", "\n".join(lines))
        print("\n".join(lines))
        return 0
    runs, loads = [], []
    for _ in range(args.runs):
        load_before = os.getloadavg()[0]
        runs.append(launch(2, _rank, args.reps, args.iters, timeout=3000)[0])
        loads.append((load_before, os.getloadavg()[0]))
    summary = {name: {"runs": [dict(_summary(r[name]["times"]), diff=max(r[name]["max_diff_vs_hand_written"].values()))
                               for r in runs], "all": _pooled(runs, name)} for name in CASES}
    (out_dir / "comm.json").write_text(json.dumps({"reps": args.reps, "iters": args.iters, "runs": args.runs,
                                                   "raw": runs, "load_average": loads, "summary": summary},
                                                  indent=1) + "\n")
    lines = ratio_table(runs, args.reps, args.iters, loads)
    _write_doc("comm-ratios", "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
