"""The hybrid-parallelism matrix: runs of examples/train_hybrid.py under torchrun, and its report.

tests/test_hybrid_matrix.py (pytest -m hybrid) runs these; with $TPCOMPILE_HYBRID_REPORT set, every
run appends one JSON line there, and

    .venv/bin/python tests/hybrid_matrix.py REPORT.jsonl

prints the markdown tables docs/hybrid.md shows.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from sgd_steps import loss_gap

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_hybrid.py"
PYTHON = sys.executable
MODELS = ("gpt", "hf:llama")
LAYOUTS = ((2, 4, 1), (4, 2, 1), (2, 2, 2), (1, 2, 4))
COMMON = ["--layers", "4", "--inputs", "8x16:long", "--steps", "5", "--clip", "1.0", "--json"]
TOLERANCE = 1e-5  # relative, on every loss and gradient norm


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def run_example(args: list[str], nproc: Optional[int] = None, timeout: float = 1800) -> dict:
    """examples/train_hybrid.py with `args`: in this interpreter (nproc None) or under torchrun; its JSON."""
    torchrun = [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", _port()]
    cmd = ([PYTHON] if nproc is None else torchrun) + [str(EXAMPLE), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1]
    out = json.loads(line)
    out["wall_s"] = round(time.monotonic() - start, 1)
    out["command"] = " ".join(["torchrun --nproc-per-node " + str(nproc) if nproc else "python",
                               "examples/train_hybrid.py", *args])
    return out


def layout_args(dp: int, tp: int, pp: int) -> list[str]:
    """--dp --tp --pp and enough microbatches for 1F1B."""
    return ["--dp", str(dp), "--tp", str(tp), "--pp", str(pp), "--microbatches", str(max(2, pp))]


def worst_relative(got: list[float], want: list[float]) -> float:
    """The largest |got - want| / |want| over the steps (inf for a count that differs or a loss not finite)."""
    return loss_gap(got, want, floor=0.0)


def record(kind: str, row: dict[str, Any]) -> None:
    """Append a result to $TPCOMPILE_HYBRID_REPORT (when set), for the tables in docs/hybrid.md."""
    path = os.environ.get("TPCOMPILE_HYBRID_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"kind": kind, **row}) + "\n")


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def tables(rows: list[dict]) -> str:
    """The markdown tables of a report: training runs against the reference, then checkpoints."""
    out = ["| model | (dp, tp, pp) | data parallel | schedule | options | max rel. loss diff | max rel. norm diff "
           "| param bytes / rank (max) | ideal 1/(dp·tp·pp) | peak RSS / rank (max, MiB) | wall s |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    def order(r: dict) -> tuple:
        """Plain 1F1B layouts first (by model and LAYOUTS), then 16 processes, schedules, options."""
        layout = (r["dp"], r["tp"], r["pp"])
        at = LAYOUTS.index(layout) if layout in LAYOUTS else len(LAYOUTS)
        fsdp_first = r["data_parallel"] != "fsdp"
        return (bool(r.get("options")), r["schedule"] != "1F1B", r["world_size"], r["model"], at, fsdp_first)

    for r in sorted((r for r in rows if r["kind"] == "train"), key=order):
        ideal = r["model_param_bytes"] / r["world_size"]
        out.append(f"| {r['model']} | ({r['dp']}, {r['tp']}, {r['pp']}) | {r['data_parallel']} | {r['schedule']} "
                   f"| {r.get('options') or '-'} | {r['loss_diff']:.1e} | {r['norm_diff']:.1e} "
                   f"| {max(r['param_bytes_per_rank']):,} | {ideal:,.0f} | {_mib(max(r['peak_rss_bytes_per_rank']))} "
                   f"| {r['wall_s']} |")
    ckpt = [r for r in rows if r["kind"] == "checkpoint"]
    if ckpt:
        out += ["", "| saved at | loaded at | tensors equal to the saved ones | max rel. loss diff, 2 more steps "
                "vs. (1, 1, 1) |", "|---|---|---|---|"]
        out += [f"| {r['saved']} | {r['loaded']} | {r['equal']} | {r['loss_diff']:.1e} |" for r in ckpt]
    return "\n".join(out)


if __name__ == "__main__":
    rows = [json.loads(line) for line in Path(sys.argv[1]).read_text().splitlines() if line.strip()]
    print(tables(rows))
