"""`tpcompile demo`: shard a model, run every rank as a real process, compare with the unsharded model."""
from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist

import tpcompile
from tpcompile.cli.common import add_model_args, load, load_plan, parse_config, shard, world_size
from tpcompile.cli.compare import check_outputs
from tpcompile.models.spec import load_model
from tpcompile.cli.verify import verdict
from tpcompile.errors import TPCompileError
from tpcompile.report.units import format_bytes


def add_parser(sub: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    """Register the subcommand."""
    p = sub.add_parser("demo", parents=[parent], help="shard a model and run every rank as a real process",
                       description="Shard MODEL (default: the bundled GPT), print the plan summary, run every "
                                   "rank as a real torch.distributed process on the example inputs (or "
                                   "--inputs), and compare each rank's output, collectives and time with the "
                                   "unsharded model (within the tolerance verify uses).")
    add_model_args(p, default_model="gpt")
    p.add_argument("--model", dest="model_flag", default=None, help=argparse.SUPPRESS)  # older spelling
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"),
                   help="torch.distributed backend of the rank processes: gloo (CPU, the default) or nccl (one CUDA "
                        "device per rank)")
    p.add_argument("--repeats", type=world_size, default=10, help="timed runs per measurement (default 10)")
    p.set_defaults(func=run)


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


def _demo_rank(rank: int, spec: str, config: dict, state: dict, args: tuple, kwargs: dict, world_size: int,
               repeats: int, plan: Optional[dict], sequence_parallel: bool) -> dict[str, Any]:
    """Child process body: rebuild the model with the parent's weights, shard it, run this rank, report."""
    import warnings

    from tpcompile.ops.collectives import FORWARD_COLLECTIVES, record

    torch.set_num_threads(_threads_per_rank(world_size))
    model, _, _ = load_model(spec, config)
    # A user's model may initialise (and draw its example inputs) at random: use the parent's exactly.
    model.load_state_dict(state)
    with warnings.catch_warnings():  # the parent has shown them once already
        warnings.simplefilter("ignore", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, world_size, example_inputs=args, example_kwargs=kwargs, plan=plan,
                             sequence_parallel=sequence_parallel)
    gm = sm.rank(rank)
    with torch.no_grad():
        with record() as events:
            output = gm(*args, **kwargs)
        ms = median_ms(lambda: gm(*args, **kwargs), repeats)
    # Only ops that exchange data in forward move bytes; the others are backward markers.
    collectives = [(e.op, e.phase, int(e.nbytes) if e.op in FORWARD_COLLECTIVES else 0, tuple(e.shape))
                   for e in events]
    return {"rank": rank, "output": output, "ms": ms, "collectives": collectives}


def results_header(threads: int, repeats: int) -> str:
    """'per-rank results (1 thread per process, median of 10 runs):'."""
    return (f"per-rank results ({threads} thread{'s' * (threads != 1)} per process, median of {repeats} "
            f"run{'s' * (repeats != 1)}):")


def check_backend(backend: str, world_size: int) -> None:
    """A backend this machine can run `world_size` ranks on, or a TPCompileError saying what to use."""
    if not dist.is_backend_available(backend):
        raise TPCompileError(f"--backend {backend}: this torch build has no {backend} backend; use --backend gloo")
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "nccl" and found < world_size:
        raise TPCompileError(f"--backend nccl needs {world_size} CUDA devices (one per rank) but this machine has "
                             f"{found}; use --backend gloo, or a --world-size of at most {found}" if found else
                             f"--backend nccl needs {world_size} CUDA devices (one per rank) but this machine has none "
                             f"(torch.cuda.is_available() is False); use --backend gloo")


def run(ns: argparse.Namespace) -> int:
    """Shard, launch the ranks, compare; 0 when every rank matches the unsharded model."""
    from tpcompile.runtime import launch

    ns.model = ns.model_flag or ns.model
    ws = ns.world_size
    check_backend(ns.backend, ws)  # before any work: a rank would fail only after the capture
    loaded = load(ns)  # refuses a model without inputs before anything runs
    print(f"capturing and sharding {loaded.name} across {ws} ranks...", flush=True)
    sm = shard(ns, loaded)
    print(sm.summary(), flush=True)
    model, args, kwargs = loaded.model, loaded.args, loaded.kwargs
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
    results = launch(ws, _demo_rank, ns.model, parse_config(ns.config), model.state_dict(), args, kwargs, ws,
                     ns.repeats, load_plan(ns), ns.sequence_parallel, backend=ns.backend)
    checks = check_outputs(expected, [res["output"] for res in results], sm)
    print(f"\n{results_header(_threads_per_rank(ws), ns.repeats)}")
    print(f"  unsharded forward: {base_ms:.3f} ms")
    for res in results:
        r = res["rank"]
        diff = max((c.diffs[r] for c in checks), default=0.0)
        counts = Counter(f"{op} ({phase})" for op, phase, _, _ in res["collectives"])
        nbytes = sum(n for _, _, n, _ in res["collectives"])
        listed = ", ".join(f"{k} x{v}" for k, v in counts.items()) or "none"
        print(f"  rank {r}: forward {res['ms']:.3f} ms ({res['ms'] / base_ms:.2f}x unsharded), "
              f"max |diff| {diff:.2e}")
        print(f"    collectives: {len(res['collectives'])}, {format_bytes(nbytes)} moved: {listed}")
    if results and min(r["ms"] for r in results) > base_ms:
        print("  (small models: a rank's time is mostly the latency of its collectives)")
    ok, numbers = verdict(checks, ws)
    print(f"OK: all {ws} ranks match the unsharded model: {numbers}" if ok else
          f"FAIL: the sharded output differs from the unsharded model: {numbers}")
    return 0 if ok else 1
