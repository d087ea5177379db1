"""The one-GPU check: `python -m bench gpu` (or `python -m bench.gpu`), at most 8 minutes on one GPU.

Parts, in order, each with its own time budget and its own try/except (one failure loses nothing
else), results written after every part:

    environment     versions, the device, an NCCL process group at world size 1
    bandwidth       device memory bandwidth from a large copy (against the H200's nominal 4.8 TB/s)
    rank_graph      tpcompile.parallelize at world size 1: rank graph on CUDA, output = the model's
    train_bf16      bf16 mixed precision: parallelize_train on a one-process mesh, and parallelize
    decode          1B-shaped Llama: decode tokens/s, CUDA graphs and eager, its fraction of the roofline
    compile         torch.compile (inductor) of a rank graph, forward and backward, against eager
    forward_ratios  the bench's MLP and GPT forwards: tpcompile over hand-written, one process

`--dry` runs the same code on the CPU at tiny sizes (gloo at world size 1) and writes to a
temporary folder unless --out-dir is given; `--skip compile` leaves inductor out. Writes
gpu.json and gpu.md (default bench/results). A hard deadline (--deadline seconds, then a grace of
GRACE_S) ends the process even inside a part that ignores its budget.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "bench" / "results"
DRY_RESULTS = Path(tempfile.gettempdir()) / "tpcompile-gpu-dry"
GRACE_S = 20.0
# name -> seconds it may take on the GPU (the dry run's tiny sizes take a fraction)
BUDGETS = {"environment": 30, "bandwidth": 30, "rank_graph": 60, "train_bf16": 90, "decode": 180, "compile": 150,
           "forward_ratios": 90}


class PartTimeout(BaseException):
    """A part ran past its budget (a BaseException, so that library code catching Exception lets it through)."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise PartTimeout()


def parts() -> dict[str, Callable]:
    """Each part's function, in running order."""
    from bench.gpu_decode import decode
    from bench.gpu_parts import bandwidth, compile_rank, environment, forward_ratios, rank_graph, train_bf16
    return {"environment": environment, "bandwidth": bandwidth, "rank_graph": rank_graph, "train_bf16": train_bf16,
            "decode": decode, "compile": compile_rank, "forward_ratios": forward_ratios}


def run_part(name: str, fn: Callable, setup: Any, budget: float) -> dict:
    """fn(setup) within `budget` seconds: its dict, with status and seconds; failures and time-outs as data."""
    start = time.perf_counter()
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(budget, 1.0))
    try:
        result = dict(fn(setup))
        result["status"] = "ok" if result.get("ok") else "failed"
    except PartTimeout:
        result = {"ok": False, "status": "timed out", "error": f"ran past its budget of {budget:.0f} s"}
    except Exception as e:  # noqa: BLE001  every failure is reported; the next part still runs
        last = traceback.extract_tb(e.__traceback__)[-1]
        result = {"ok": False, "status": "failed", "error": f"{type(e).__name__}: {e}"[:2000],
                  "where": f"{os.path.relpath(last.filename, ROOT)}:{last.lineno}"}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    result["seconds"] = time.perf_counter() - start
    return result


def headline(name: str, r: dict) -> str:
    """One line of what a part found."""
    if r["status"] != "ok" and "error" in r:
        return r["error"].splitlines()[0][:300]
    if name == "environment":
        return f"{r.get('name', r['device'])}, torch {r['torch']}, {r['backend']} at world size {r['world_size']}"
    if name == "bandwidth":
        return (f"{r['bytes_per_s'] / 1e9:,.0f} GB/s copy ({r['fraction_of_nominal']:.1%} of the H200's nominal "
                f"{r['nominal_bytes_per_s'] / 1e12:.1f} TB/s)")
    if name == "rank_graph":
        return (f"max abs diff {r['max_abs_diff']:.1e}, tensors on {', '.join(r['tensor_devices'])}, "
                f"forward {r['forward_ms']:.2f} ms")
    if name == "train_bf16":
        return (f"losses {', '.join(f'{x:.4f}' for x in r['parallelize_train']['losses'])} (parallelize_train), "
                f"{', '.join(f'{x:.4f}' for x in r['parallelize']['losses'])} (parallelize), reference "
                f"{', '.join(f'{x:.4f}' for x in r['reference_losses'])}")
    if name == "decode":
        t, roof = r["tpcompile"], r["roofline"]
        return (f"{t['decode_tokens_per_s']:.0f} tokens/s ({t['decode_ms_per_token']:.2f} ms/token), "
                f"{roof['fraction']:.0%} of the roofline at the measured bandwidth "
                f"({roof['fraction_of_nominal']:.0%} at 4.8 TB/s); eager "
                f"{r['tpcompile_eager']['decode_tokens_per_s']:.0f} tokens/s, HF generate "
                f"{r['hf_generate']['call_tokens_per_s']:.0f} tokens/s per call")
    if name == "compile":
        return (f"first step {r['first_step_s']:.1f} s, next {r['next_step_s'] * 1e3:.1f} ms, max abs diff "
                f"{r['max_abs_diff']:.1e}")
    if name == "forward_ratios":
        return "; ".join(f"{w}: tpcompile / hand-written {r[w]['ratio_to_hand_written']['tpcompile']:.2f}, comm=False "
                         f"{r[w]['ratio_to_hand_written']['tpcompile, comm=False']:.2f}, one process "
                         f"{r[w]['ratio_to_hand_written']['one process']:.2f}" for w in ("mlp", "gpt") if w in r)
    return r["status"]


def render(result: dict) -> str:
    """gpu.md: one row per part, then what the run was."""
    m = result["meta"]
    lines = [f"# One-GPU check{' (dry run on the CPU: sizes and times mean nothing)' if m['dry'] else ''}", "",
             f"`{m['command']}` on {m['date']}, {m['wall_s']:.0f} s in all (deadline {m['deadline_s']:.0f} s).", "",
             "| part | status | seconds | result |", "|---|---|---|---|"]
    for name, r in result["parts"].items():
        lines.append(f"| {name} | {r['status']} | {r.get('seconds', 0):.1f} | {headline(name, r)} |")
    lines += ["", "Every number is in gpu.json beside this file (bench/gpu.py, bench/gpu_parts.py, "
              "bench/gpu_decode.py)."]
    return "\n".join(lines) + "\n"


def write(result: dict, out_dir: Path) -> None:
    """gpu.json and gpu.md, as they stand now."""
    result["meta"]["wall_s"] = time.perf_counter() - result["meta"]["_start"]
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {k: v for k, v in result["meta"].items() if not k.startswith("_")}
    (out_dir / "gpu.json").write_text(json.dumps({**result, "meta": meta}, indent=1, default=str) + "\n")
    (out_dir / "gpu.md").write_text(render(result))


def _watchdog(deadline: float, out_dir: Path, result: dict) -> None:
    """End the process GRACE_S after the deadline, whatever a part is doing; what was written stays."""
    time.sleep(max(0.0, deadline - time.monotonic()) + GRACE_S)
    print(f"gpu check: hard deadline reached; results so far in {out_dir}", flush=True)
    os._exit(3)


def main(argv: list[str] | None = None) -> int:
    """Start the group, run every part within the deadline, write the report."""
    ap = argparse.ArgumentParser(prog="python -m bench gpu", description=__doc__.splitlines()[0])
    ap.add_argument("--dry", action="store_true", help="tiny sizes on the CPU (gloo), the same code path")
    ap.add_argument("--skip", default="", help="comma-separated parts to leave out, e.g. compile")
    ap.add_argument("--deadline", type=float, default=450.0, help="seconds for all parts together")
    ap.add_argument("--out-dir", type=Path, default=None)
    opts = ap.parse_args(argv)
    out_dir = opts.out_dir or (DRY_RESULTS if opts.dry else RESULTS)
    start, clock = time.perf_counter(), time.monotonic()
    import torch

    from bench.gpu_parts import Setup
    from tpcompile.runtime import init_from_env
    from tpcompile.runtime.torchrun import shutdown
    if not opts.dry and not torch.cuda.is_available():
        print("gpu check: no CUDA device (torch.cuda.is_available() is False); run with --dry on a CPU",
              file=sys.stderr)
        return 2
    init_from_env("gloo" if opts.dry else "nccl", standalone=True)
    setup = Setup(torch.device("cpu") if opts.dry else torch.device("cuda", torch.cuda.current_device()), opts.dry)
    skip = {p for p in opts.skip.split(",") if p}
    args = argv if argv is not None else sys.argv[1:]
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    result: dict[str, Any] = {"meta": {"command": "python -m bench gpu " + " ".join(args), "date": date,
                                       "dry": opts.dry, "deadline_s": opts.deadline, "_start": start}, "parts": {}}
    threading.Thread(target=_watchdog, args=(clock + opts.deadline, out_dir, result), daemon=True).start()
    for name, fn in parts().items():
        left = opts.deadline - (time.monotonic() - clock)
        if name in skip:
            result["parts"][name] = {"ok": False, "status": "skipped", "error": "--skip"}
        elif left < 5:
            result["parts"][name] = {"ok": False, "status": "not run", "error": "no time left before the deadline"}
        else:
            budget = min(BUDGETS[name], left)
            print(f"[{time.perf_counter() - start:6.1f} s] {name} (budget {budget:.0f} s)...", flush=True)
            result["parts"][name] = run_part(name, fn, setup, budget)
            r = result["parts"][name]
            print(f"[{time.perf_counter() - start:6.1f} s] {name}: {r['status']} in {r['seconds']:.1f} s: "
                  f"{headline(name, r)}", flush=True)
        write(result, out_dir)
    shutdown()
    print(render(result), flush=True)
    print(f"wrote {out_dir}/gpu.json and gpu.md", flush=True)
    wanted = [r for r in result["parts"].values() if r["status"] != "skipped"]
    return 0 if all(r["ok"] for r in wanted) else 1


if __name__ == "__main__":
    sys.exit(main())
