"""`python -m bench.comm_ratio [--reps N] [--iters K] [--compile]`: tpcompile's communication passes
against hand-written Megatron at world size 2 on gloo, as ratios measured in one run.

Cases: the MLP stack and the GPT of bench/workloads.py in forward (no grad), and the training step
(forward, loss, backward) of the parallel-block model of bench/parallel_block.py. Contenders on each
rank: the hand-written split, tpcompile with `comm=CommOptions(asynchronous=True)` and tpcompile
without the communication passes. Each repetition times every contender for K iterations (order
rotated per repetition, both ranks started together by a barrier, the slower rank's time kept);
the ratio to hand-written is taken per repetition and the median, a 95% bootstrap interval of the
median (so a reader can tell a difference from the machine's noise), min and max are reported.
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
CONTENDERS = ("hand-written", "tpcompile", "tpcompile, comm off")


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
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tpcompile.TPCompileWarning)
            fast = tpcompile.shard(copy.deepcopy(model), 2, example_inputs=inputs,
                                   comm=tpcompile.CommOptions(asynchronous=True)).rank(rank)
            plain = tpcompile.shard(copy.deepcopy(model), 2, example_inputs=inputs).rank(rank)
        modules = {"hand-written": hand_cls(model, rank, 2), "tpcompile": fast, "tpcompile, comm off": plain}
        steps = {k: _step(m, inputs, loss, train) for k, m in modules.items()}
        ref = steps["hand-written"]().detach()
        diffs = {k: float((s().detach() - ref).abs().max()) for k, s in steps.items()}
        for s in steps.values():  # warm-up
            s()
        times: dict[str, list[float]] = {k: [] for k in steps}
        for rep in range(reps):
            order = CONTENDERS[rep % 3:] + CONTENDERS[:rep % 3]
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


def _summary(times: dict[str, list[float]]) -> dict:
    hand = times["hand-written"]
    out = {}
    for k in CONTENDERS[1:]:
        ratios = sorted(t / h for t, h in zip(times[k], hand))
        out[k] = {"median": statistics.median(ratios), "ci95": median_interval(ratios),
                  "min": ratios[0], "max": ratios[-1]}
    out["hand-written ms"] = 1e3 * statistics.median(hand)
    return out


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
    load_before = os.getloadavg()[0]
    res = launch(2, _rank, args.reps, args.iters, timeout=3000)[0]
    load_after = os.getloadavg()[0]
    table = {name: dict(_summary(r["times"]), diff=max(r["max_diff_vs_hand_written"].values()))
             for name, r in res.items()}
    (out_dir / "comm.json").write_text(json.dumps({"reps": args.reps, "iters": args.iters, "raw": res,
                                                   "load_average": [load_before, load_after],
                                                   "summary": table}, indent=1) + "\n")
    lines = [f"{args.reps} repetitions of {args.iters} iterations, world size 2, gloo, one thread per rank; "
             f"time / hand-written time per repetition: median [95% bootstrap interval of the median] "
             f"(min-max). The machine's 1-minute load "
             f"average ({os.cpu_count()} cores) was {load_before:.1f} before and {load_after:.1f} after.", "",
             "| case | hand-written (ms) | tpcompile, comm=CommOptions(asynchronous=True) | tpcompile, no comm passes "
             "| max output diff |", "|---|---|---|---|---|"]
    for name, s in table.items():
        cells = [f"{s[k]['median']:.3f} [{s[k]['ci95'][0]:.3f}-{s[k]['ci95'][1]:.3f}] "
                 f"({s[k]['min']:.3f}-{s[k]['max']:.3f})" for k in CONTENDERS[1:]]
        lines.append(f"| {name} | {s['hand-written ms']:.2f} | {cells[0]} | {cells[1]} | {s['diff']:.1e} |")
    lines += [""] + [f"- {name}: {r['describe']}" for name, r in res.items()]
    _write_doc("comm-ratios", "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
