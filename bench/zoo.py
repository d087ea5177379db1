"""The whole zoo: every causal-LM architecture transformers ships, sharded at 2 and 4 ranks against the original.

Run from the repository root:  python -m bench.zoo  (or python bench/zoo.py)
Each architecture runs in its own process under a time budget, so a crash or hang costs only that architecture;
its row is cached in bench/results/zoo.json as soon as it is done, and a later run skips the cached ones (resumable).
--only NAME runs one (repeatable), --rerun ignores the cache, --render only rewrites the docs from the cache, and
the docs section sits between the zoo markers at the end of docs/architectures.md.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TPCOMPILE_PROGRESS", "0")

import torch  # noqa: E402

from bench.zoo_render import reason_of, write_section  # noqa: E402
from hf_zoo import EXAMPLE, RUN, one_line, unsharded_reason, zoo_build, zoo_inputs, zoo_types  # noqa: E402

CACHE = ROOT / "bench" / "results" / "zoo.json"
DOCS = ROOT / "docs" / "architectures.md"
WORLD_SIZES = (2, 4)
BUDGET_S = 180.0  # per architecture, both world sizes; the loaded 2-core machine makes 120 s too tight
HELD = 1.25  # a rank may hold at most HELD / world_size of the parameter bytes


def layer_of(block: str) -> Optional[str]:
    """The numbered layer a block lies in ('model.layers.3.mlp' -> 'model.layers.3'), None outside any layer."""
    parts = block.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return None


def collectives(sm: Any, events: list) -> dict[str, Any]:
    """Rank 0's forward collectives: counts by op, by block, and the most and fewest in one numbered layer."""
    from tpcompile.report.plan_table import plan_report

    rows = plan_report(sm, [e for e in events if e.rank == 0 and e.phase == "forward"], "").collectives
    by_block: Counter = Counter(r.block for r in rows)
    per_layer: Counter = Counter()
    for r in rows:
        if (layer := layer_of(r.block)) is not None:
            per_layer[layer] += 1
    return {"counts": dict(Counter(r.op for r in rows)), "blocks": dict(by_block),
            "per_layer": [min(per_layer.values(), default=0), max(per_layer.values(), default=0)],
            "outside_layers": sum(n for b, n in by_block.items() if layer_of(b) is None)}


def run_ws(model_type: str, ws: int, sequence_parallel: bool = False) -> dict[str, Any]:
    """Shard `model_type` at `ws` ranks, simulate them on another batch and length, compare with the original; with
    `sequence_parallel`, its gradients too (`grads`: tpcompile.check_gradients)."""
    import tpcompile
    from hf_models import balanced_bytes, param_bytes
    from tpcompile.cli.compare import check_outputs
    from tpcompile.ops import collectives as C

    start = time.perf_counter()
    row: dict[str, Any] = {"ws": ws}
    model = zoo_build(model_type)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", tpcompile.TPCompileWarning)
            sm = tpcompile.shard(model, ws, example_kwargs=zoo_inputs(model, *EXAMPLE, seed=1),
                                 sequence_parallel=sequence_parallel)
        row["warnings"] = [str(w.message) for w in caught if issubclass(w.category, tpcompile.TPCompileWarning)]
        local, total = param_bytes(model, sm)
        row.update(share=local / total, total_bytes=total, balanced=local / balanced_bytes(model, sm))
        kw = zoo_inputs(model, *RUN, seed=2)
        with torch.no_grad():
            ref = model(**kw)
            with C.record() as events:
                outs = tpcompile.simulate(sm, **kw)
        checks = check_outputs(ref, outs, sm)
        row.update(equal=all(c.ok for c in checks), diff=max((c.worst for c in checks), default=0.0),
                   allowed=min((c.allowed for c in checks), default=0.0), **collectives(sm, list(events)))
        bad = [c for c in checks if not c.ok]
        if bad:
            row["reason"] = f"output {bad[0].path} differs by {bad[0].worst:.2e} (allowed {bad[0].allowed:.2e})"
        if sequence_parallel and row["equal"]:  # the backward's collectives differ from the forward's under SP
            try:
                report = tpcompile.check_gradients(model, sm, **kw)
                row["grads"], why = report.ok, report.verdict()
            except Exception as exc:  # noqa: BLE001  a backward that fails is the row's reason; the logits stand
                row["grads"], why = False, "backward: " + one_line(exc)
            if not row["grads"]:
                row["reason"] = why[:300]
    except Exception as exc:  # noqa: BLE001  a failing world size is a row with its reason, not a crash
        row.update(equal=False, reason=one_line(exc), error=type(exc).__name__)
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


def run_arch(model_type: str, world_sizes: tuple[int, ...] = WORLD_SIZES,
             sequence_parallel: bool = False) -> dict[str, Any]:
    """One architecture's row: why it cannot run unsharded, or its result at each of `world_sizes`."""
    import transformers

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    start = time.perf_counter()
    row: dict[str, Any] = {"arch": model_type}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' own notes while building; tpcompile's are recorded
        why = unsharded_reason(model_type)
    if why is not None:
        row.update(status="unsharded fails", reason=why)
    else:
        row["params"] = sum(p.numel() for p in zoo_build(model_type).parameters())
        row["ws"] = {str(ws): run_ws(model_type, ws, sequence_parallel) for ws in world_sizes}
        row["status"] = status(row)
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


def status(row: dict[str, Any]) -> str:
    """'split' (equal and held x ws <= HELD at every world size), 'equal' (equal, not split well), or 'fails'."""
    runs = row["ws"].values()
    if not all(r.get("equal") for r in runs):
        return "fails"
    return "split" if all(r["share"] * r["ws"] <= HELD for r in runs) else "equal"


def run_isolated(model_type: str, budget_s: float, world_sizes: tuple[int, ...] = WORLD_SIZES,
                 sequence_parallel: bool = False) -> dict[str, Any]:
    """run_arch in a child process under a time budget; a crash or timeout becomes a row with its reason."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--one", model_type, "--result", str(out),
               *[f"--world-size={ws}" for ws in world_sizes], *(["--sequence-parallel"] if sequence_parallel else [])]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TPCOMPILE_PROGRESS": "0"}
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        try:
            _, err = proc.communicate(timeout=budget_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the child's own session: it and anything it started
            proc.communicate()
            return {"arch": model_type, "status": "fails", "reason": f"timed out: more than {budget_s:.0f} s "
                    f"for world sizes {world_sizes}", "seconds": round(time.perf_counter() - start, 2)}
        if out.exists():
            return json.loads(out.read_text())
        last = [line for line in (err or "").splitlines() if line.strip()][-1:] or [f"exit status {proc.returncode}"]
        return {"arch": model_type, "status": "fails", "reason": f"crashed: {last[0].strip()[:300]}",
                "seconds": round(time.perf_counter() - start, 2)}


def run_rows(rows: dict[str, Any], names: list[str], args: Any, cache: Path, ws: int, sequence_parallel: bool = False,
             show: Any = lambda row: row["status"]) -> list[str]:
    """The runs at one world size (bench/zoo_uneven.py, bench/zoo_sp.py): each architecture of --only (all by
    default) without a row in `rows` (every one with --rerun) run and cached, unless --render; then the names still
    without a row, said."""
    if not args.render:
        for name in args.only or names:
            if name in rows and not args.rerun:
                continue
            rows[name] = run_isolated(name, args.budget, (ws,), sequence_parallel=sequence_parallel)
            save_cache(cache, rows, (ws,))
            print(f"{name}: {show(rows[name])} ({rows[name]['seconds']:.0f} s)", file=sys.stderr, flush=True)
    missing = [n for n in names if n not in rows]
    if missing:
        print(f"not written: {len(missing)} architectures have no row yet ({', '.join(missing[:5])}, ...)",
              file=sys.stderr)
    return missing


def load_cache(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The cache's versions and dates, and its rows by architecture (both {} when there is no cache)."""
    data = json.loads(path.read_text()) if path.exists() else {}
    return data.get("meta", {}), data.get("archs", {})


def save_cache(path: Path, rows: dict[str, Any], world_sizes: tuple[int, ...] = WORLD_SIZES) -> None:
    """Write the rows with the versions they were measured with, atomically (a killed run keeps the last)."""
    import transformers

    meta = {"torch": torch.__version__, "transformers": transformers.__version__, "example": EXAMPLE, "run": RUN,
            "world_sizes": world_sizes, "held": HELD, "date": time.strftime("%Y-%m-%d")}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"meta": meta, "archs": dict(sorted(rows.items()))}, indent=1) + "\n")
    tmp.replace(path)


def main(argv: Optional[list[str]] = None) -> int:
    """Run every architecture not yet cached, cache each row, then write the docs section."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", default=[], metavar="NAME", help="this model type (repeatable)")
    ap.add_argument("--rerun", action="store_true", help="run the chosen architectures even when cached")
    ap.add_argument("--render", action="store_true", help="only write the docs section from the cache")
    ap.add_argument("--partial", action="store_true", help="write the docs although some rows are missing")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds per architecture (both world sizes)")
    ap.add_argument("--world-size", type=int, action="append", metavar="N",
                    help=f"shard at N ranks (repeatable; default {' and '.join(map(str, WORLD_SIZES))}); other world "
                    "sizes than the default need their own --cache and --docs")
    ap.add_argument("--cache", type=Path, default=CACHE)
    ap.add_argument("--docs", type=Path, default=DOCS)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # the child process: run one architecture
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--sequence-parallel", action="store_true", help=argparse.SUPPRESS)  # the child's (bench/zoo_sp.py)
    args = ap.parse_args(argv)
    if args.one:
        args.result.write_text(json.dumps(run_arch(args.one, tuple(args.world_size or WORLD_SIZES),
                                                   args.sequence_parallel)))
        return 0
    names = zoo_types()
    unknown = [n for n in args.only if n not in names]
    if unknown:
        ap.error(f"unknown model type {', '.join(unknown)}; the causal-LM types are {', '.join(names)}")
    rows = {k: v for k, v in load_cache(args.cache)[1].items() if k in names}
    if not args.render:
        for name in args.only or names:
            if name in rows and not args.rerun:
                continue
            rows[name] = run_isolated(name, args.budget, tuple(args.world_size or WORLD_SIZES))
            save_cache(args.cache, rows, tuple(args.world_size or WORLD_SIZES))
            print(f"{name}: {rows[name]['status']} ({rows[name]['seconds']:.0f} s) {reason_of(rows[name])}",
                  file=sys.stderr, flush=True)
    missing = [n for n in names if n not in rows]
    if missing and not args.partial:
        print(f"not written: {len(missing)} architectures have no row yet ({', '.join(missing[:5])}, ...); "
              "--partial writes the section anyway", file=sys.stderr)
        return 1
    write_section(args.docs, [rows[n] for n in names if n in rows], load_cache(args.cache)[0], missing=len(missing))
    print(f"wrote the zoo section of {args.docs}", file=sys.stderr)
    return 0 if all(r["status"] == "split" for r in rows.values() if r["status"] != "unsharded fails") else 1


if __name__ == "__main__":
    sys.exit(main())
