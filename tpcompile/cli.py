"""The `tpcompile` command line: plan, dump, diff, check and a multi-process demo."""

from __future__ import annotations

import argparse
import difflib
import math
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

import tpcompile
from tpcompile.errors import TPCompileError
from tpcompile.loading import ACCEPTED_FORMS, example_inputs_of, load_model
from tpcompile.models import MODEL_NAMES, build

DEMO_TOLERANCE = 1e-5


def _tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor in a nest of tuples, lists and mappings (model output classes are mappings)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def max_abs_diff(expected: Any, actual: Any) -> float:
    """Largest absolute elementwise difference over all tensors of two output structures."""
    exp, act = _tensors(expected), _tensors(actual)
    if len(exp) != len(act) or any(e.shape != a.shape for e, a in zip(exp, act)):
        return math.inf
    return max((float((e.detach().float() - a.detach().float()).abs().max()) for e, a in zip(exp, act)
                if e.numel()), default=0.0)


def median_ms(fn: Callable[[], Any], repeats: int, warmup: int = 2) -> float:
    """Median wall time of `fn` in milliseconds after a few warm-up calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _threads_per_rank(world_size: int) -> int:
    """Split the machine's cores between the rank processes so they do not oversubscribe it."""
    return max(1, (os.cpu_count() or 1) // world_size)


def _demo_rank(rank: int, name: str, world_size: int, repeats: int) -> dict[str, Any]:
    """Child process body: rebuild and shard the model, run this rank, report output, collectives and time."""
    from tpcompile.collectives import FORWARD_COMMUNICATING, record

    torch.set_num_threads(_threads_per_rank(world_size))
    model = build(name)
    args, kwargs = example_inputs_of(model, name)
    gm = tpcompile.shard(model, world_size, example_inputs=args, example_kwargs=kwargs).rank(rank)
    with torch.no_grad():
        with record() as events:
            output = gm(*args, **kwargs)
        ms = median_ms(lambda: gm(*args, **kwargs), repeats)
    # Only ops that exchange data in forward move bytes; the others are backward markers.
    collectives = [(e.op, e.phase, int(e.nbytes) if e.op in FORWARD_COMMUNICATING else 0, tuple(e.shape))
                   for e in events]
    return {"rank": rank, "output": output, "ms": ms, "collectives": collectives}


def _format_bytes(n: float) -> str:
    """Bytes in B, KiB or MiB."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024 or unit == "MiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} MiB"


def cmd_demo(ns: argparse.Namespace) -> int:
    """Shard a bundled model, run every rank as a real process and compare with the unsharded model."""
    from tpcompile.runtime import launch

    ws, name = ns.world_size, ns.model
    print(f"building bundled model {name!r}...", flush=True)
    model = build(name)
    args, kwargs = example_inputs_of(model, name)
    print(f"capturing and sharding across {ws} ranks...", flush=True)
    sm = tpcompile.shard(model, ws, example_inputs=args, example_kwargs=kwargs)
    print(sm.summary(), flush=True)
    # The reference runs on as many threads as one rank gets, so the timings compare like with like.
    threads = torch.get_num_threads()
    torch.set_num_threads(_threads_per_rank(ws))
    try:
        with torch.no_grad():
            expected = model(*args, **kwargs)
            base_ms = median_ms(lambda: model(*args, **kwargs), ns.repeats)
    finally:
        torch.set_num_threads(threads)
    print(f"launching {ws} {ns.backend} processes...", flush=True)
    results = launch(ws, _demo_rank, name, ws, ns.repeats, backend=ns.backend)
    worst = 0.0
    print(f"\nper-rank results ({_threads_per_rank(ws)} threads per process, median of {ns.repeats} runs):")
    print(f"  unsharded forward: {base_ms:.3f} ms")
    for res in results:
        diff = max_abs_diff(expected, res["output"])
        worst = max(worst, diff)
        counts = Counter(f"{op} ({phase})" for op, phase, _, _ in res["collectives"])
        nbytes = sum(n for _, _, n, _ in res["collectives"])
        listed = ", ".join(f"{k} x{v}" for k, v in counts.items()) or "none"
        print(f"  rank {res['rank']}: forward {res['ms']:.3f} ms ({res['ms'] / base_ms:.2f}x unsharded), "
              f"max |diff| {diff:.2e}")
        print(f"    collectives: {len(res['collectives'])}, {_format_bytes(nbytes)} moved: {listed}")
    if results and min(r["ms"] for r in results) > base_ms:
        print("  (the bundled models are tiny: a rank's time is mostly the latency of its collectives)")
    if worst > DEMO_TOLERANCE:
        print(f"FAIL: sharded output differs from the unsharded model by {worst:.2e} > {DEMO_TOLERANCE:.0e}")
        return 1
    print(f"OK: all {ws} ranks match the unsharded model (max |diff| {worst:.2e} <= {DEMO_TOLERANCE:.0e})")
    return 0


def _load_and_shard(spec: str, world_size: int) -> tuple[Any, Any, tuple, dict]:
    """Load MODEL and shard it; returns (model, sharded, args, kwargs)."""
    print(f"loading {spec}...", file=sys.stderr, flush=True)
    model, args, kwargs = load_model(spec)
    print(f"capturing and sharding across {world_size} ranks...", file=sys.stderr, flush=True)
    sm = tpcompile.shard(model, world_size, example_inputs=args, example_kwargs=kwargs)
    return model, sm, args, kwargs


def _ranks(ns: argparse.Namespace, default: Sequence[int]) -> list[int]:
    """The ranks chosen with --rank, checked against the world size."""
    if ns.rank is None:
        return list(default)
    if not 0 <= ns.rank < ns.world_size:
        raise TPCompileError(f"--rank {ns.rank} is out of range for world size {ns.world_size} "
                             f"(valid ranks are 0..{ns.world_size - 1})")
    return [ns.rank]


def cmd_plan(ns: argparse.Namespace) -> int:
    """Print the sharding plan summary."""
    _, sm, _, _ = _load_and_shard(ns.model, ns.world_size)
    print(sm.summary())
    return 0


def cmd_dump(ns: argparse.Namespace) -> int:
    """Print each rank's generated code, or write one file per rank."""
    ranks = _ranks(ns, range(ns.world_size))
    _, sm, _, _ = _load_and_shard(ns.model, ns.world_size)
    if ns.out is not None:
        out = Path(ns.out)
        out.mkdir(parents=True, exist_ok=True)
        for r in ranks:
            path = out / f"rank{r}.py"
            path.write_text(sm.rank(r).code)
            print(path)
        return 0
    for r in ranks:
        print(f"# ---- rank {r} of {ns.world_size} ----")
        print(sm.rank(r).code)
    return 0


def cmd_diff(ns: argparse.Namespace) -> int:
    """Print a unified diff from the captured graph's code to each chosen rank's code."""
    ranks = _ranks(ns, [0])
    _, sm, _, _ = _load_and_shard(ns.model, ns.world_size)
    before = sm.captured.code.splitlines(keepends=True)
    for r in ranks:
        after = sm.rank(r).code.splitlines(keepends=True)
        sys.stdout.writelines(difflib.unified_diff(before, after, fromfile="captured", tofile=f"rank{r}"))
    return 0


def cmd_check(ns: argparse.Namespace) -> int:
    """Simulate every rank on the example inputs and compare with the original model."""
    model, sm, args, kwargs = _load_and_shard(ns.model, ns.world_size)
    if not args and not kwargs:
        raise TPCompileError(f"check needs example inputs, and {ns.model} has no example_inputs(); "
                             "add an example_inputs() method to the model")
    with torch.no_grad():
        expected = model(*args, **kwargs)
        outputs = tpcompile.simulate(sm, *args, **kwargs)
    worst = 0.0
    for r, out in enumerate(outputs):
        diff = max_abs_diff(expected, out)
        worst = max(worst, diff)
        print(f"rank {r}: max |diff| {diff:.2e}")
    verdict = "OK" if worst <= ns.tol else "FAIL"
    print(f"{verdict}: max difference {worst:.2e} (tolerance {ns.tol:.0e}) over {len(outputs)} ranks")
    return 0 if worst <= ns.tol else 1


def _positive_int(text: str) -> int:
    """argparse type for a world size."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with all subcommands."""
    parser = argparse.ArgumentParser(prog="tpcompile", description="Automatic tensor parallelism for PyTorch models.",
                                     epilog=f"MODEL is one of: {ACCEPTED_FORMS}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="shard a bundled model and run every rank as a real process")
    demo.add_argument("--world-size", "-w", type=_positive_int, default=2)
    demo.add_argument("--model", default="gpt", choices=MODEL_NAMES)
    demo.add_argument("--backend", default="gloo")
    demo.add_argument("--repeats", type=_positive_int, default=10, help="timed runs per measurement")
    demo.set_defaults(func=cmd_demo)

    helps = {
        "plan": (cmd_plan, "print the sharding plan summary"),
        "dump": (cmd_dump, "print each rank's generated code"),
        "diff": (cmd_diff, "unified diff from the captured graph to a rank's graph"),
        "check": (cmd_check, "simulate all ranks and compare with the original model"),
    }
    for name, (func, text) in helps.items():
        p = sub.add_parser(name, help=text, epilog=f"MODEL is one of: {ACCEPTED_FORMS}")
        p.add_argument("model", metavar="MODEL")
        p.add_argument("-w", "--world-size", type=_positive_int, default=2)
        if name in ("dump", "diff"):
            p.add_argument("--rank", "-r", type=int, default=None)
        if name == "dump":
            p.add_argument("--out", "-o", default=None, help="write DIR/rank<R>.py instead of printing")
        if name == "check":
            p.add_argument("--tol", type=float, default=DEMO_TOLERANCE, help="maximum absolute difference")
        p.set_defaults(func=func)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line and return the exit code."""
    try:
        ns = build_parser().parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return ns.func(ns)
    except TPCompileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
