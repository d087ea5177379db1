"""tpcompile against a hand-written Megatron-style split of the bundled GPT, on gloo processes.

Run from the repository root:  python bench/compare.py [--world-size 2] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import tpcompile  # noqa: E402
from tpcompile import collectives as C  # noqa: E402
from tpcompile.models import GPT, GPTConfig  # noqa: E402
from tpcompile.runtime import launch  # noqa: E402

from handwritten_tp import CommLog, TPGPT  # noqa: E402

CONFIG = dict(vocab_size=1024, block_size=128, n_layer=4, n_head=8, n_embd=256)
BATCH, SEQ = 4, 128
WARMUP, ITERS = 3, 20
SEED = 0
TOLERANCE = 1e-4


def build_model() -> GPT:
    """The benchmark GPT with fixed weights, in eval mode."""
    torch.manual_seed(SEED)
    return GPT(GPTConfig(**CONFIG)).eval()


def token_ids() -> torch.Tensor:
    """The fixed (BATCH, SEQ) batch of token ids."""
    return torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def parameter_bytes(module: torch.nn.Module) -> int:
    """Bytes of the distinct parameter storages a module holds (tied weights count once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for p in module.parameters():
        key = (p.data_ptr(), p.numel())
        if key not in seen:
            seen.add(key)
            total += p.numel() * p.element_size()
    return total


class NoComm(CommLog):
    """Stands in for the collectives with local work of the same output shape (compute only)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x unchanged."""
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """x repeated world-size times along the last dim."""
        return torch.cat([x] * dist.get_world_size(), dim=-1)


def _stub_comm(tp: TPGPT) -> TPGPT:
    """tp with every collective replaced by NoComm."""
    comm = NoComm()
    tp.comm = comm
    for m in tp.modules():
        if hasattr(m, "comm"):
            m.comm = comm
    return tp


def _timed(fn: Any, idx: torch.Tensor) -> float:
    """Seconds one forward takes on the slowest rank, all ranks starting together."""
    dist.barrier()
    start = time.perf_counter()
    fn(idx)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _count(ops: list[tuple[str, int]]) -> tuple[dict[str, int], int]:
    """Calls per op and total bytes of a list of (op, bytes)."""
    counts: dict[str, int] = {}
    for op, _ in ops:
        counts[op] = counts.get(op, 0) + 1
    return counts, sum(n for _, n in ops)


def rank_main(rank: int, ws: int, state: dict, idx: torch.Tensor, ref: torch.Tensor, iters: int) -> dict:
    """One process: build both splits of the same weights, check, count and time them."""
    model = GPT(GPTConfig(**CONFIG)).eval()
    model.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tpcompile.TPCompileWarning)
        start = time.perf_counter()
        sm = tpcompile.shard(model, ws, example_inputs=(idx,))
        gm = sm.rank(rank)
        shard_s = time.perf_counter() - start
    hand = TPGPT(model, rank, ws)
    variants = {"tpcompile": gm, "hand-written": hand}
    out: dict[str, Any] = {"shard_s": shard_s}
    with torch.no_grad():
        for name, fn in variants.items():
            if name == "tpcompile":
                with C.record() as events:
                    y = fn(idx)
                ops = [(e.op, e.nbytes) for e in events
                       if e.phase == "forward" and e.op in C.FORWARD_COMMUNICATING]
            else:
                hand.comm.clear()
                y = fn(idx)
                ops = list(hand.comm.calls)
            counts, nbytes = _count(ops)
            out[name] = {"diff": float((y - ref).abs().max()), "counts": counts, "bytes": nbytes,
                         "param_bytes": parameter_bytes(fn), "times": []}
        for _ in range(WARMUP):
            for fn in variants.values():
                fn(idx)
        # Alternate the two variants so drift in machine load hits both alike.
        for _ in range(iters):
            for name, fn in variants.items():
                out[name]["times"].append(_timed(fn, idx))
        # Context for the machine: the same rank's arithmetic with no communication at all.
        compute = _stub_comm(TPGPT(model, rank, ws))
        compute(idx)
        out["compute_only"] = [_timed(compute, idx) for _ in range(max(5, iters // 2))]
    out["static_collectives"] = sm.collectives()
    return out


def time_unsharded(model: GPT, idx: torch.Tensor, iters: int) -> list[float]:
    """Forward seconds of the whole model in this process on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            for _ in range(WARMUP):
                model(idx)
            times = []
            for _ in range(iters):
                start = time.perf_counter()
                model(idx)
                times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return times


def _fmt_counts(counts: dict[str, int]) -> str:
    """'9 all_reduce, 1 all_gather' style text."""
    return ", ".join(f"{v} {k}" for k, v in counts.items()) or "none"


def _fmt_bytes(n: int) -> str:
    """Bytes with a binary-prefix unit and the exact count."""
    return f"{n / 2**20:.2f} MiB ({n:,} B)"


def _spread(times: list[float]) -> str:
    """'fastest; lo-hi' of a list of seconds in ms: the minimum and the middle half."""
    q = statistics.quantiles(times, n=4)
    return f"{1e3 * min(times):.1f}; {1e3 * q[0]:.1f}-{1e3 * q[2]:.1f}"


def render(ws: int, iters: int, rows: list[dict], checks: dict, static: list, compute_ms: float,
           wall_s: float) -> str:
    """The markdown report."""
    hand_ms = next(r["ms"] for r in rows if r["key"] == "hand-written")
    lines = [
        "# tpcompile vs. hand-written tensor parallelism",
        "",
        "Produced by `python bench/compare.py`"
        f" on {datetime.date.today().isoformat()} with torch {torch.__version__},"
        f" Python {platform.python_version()}, {platform.machine()} CPU, gloo backend.",
        "",
        "| variant | forward ms | ratio vs hand-written | collectives | bytes moved per rank | parameter bytes per rank |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['ms']:.2f} | {r['ms'] / hand_ms:.2f}x | {r['collectives']} "
                     f"| {r['bytes']} | {r['params']} |")
    cfg = ", ".join(f"{k}={v}" for k, v in CONFIG.items())
    lines += [
        "",
        "## Setup",
        "",
        f"- Model: bundled `GPT(GPTConfig({cfg}))` (defaults otherwise: sdpa attention, fused qkv,"
        " tied embedding/head, bias, dropout 0), fp32, eval mode, `torch.no_grad()`.",
        f"- Input: token ids of shape ({BATCH}, {SEQ}); seed {SEED} for the weights.",
        f"- Sharded variants: world size {ws}, one process per rank on gloo over 127.0.0.1"
        " (`tpcompile.runtime.launch`), one intra-op thread per process.",
        "- Unsharded: the original model in the parent process, one thread.",
        f"- forward ms: median of {iters} forwards after {WARMUP} warm-up forwards. For the sharded"
        " variants each forward starts after a barrier and counts the slowest rank; the two"
        " sharded variants alternate forward by forward. Fastest forward; middle half of the forwards (ms): "
        + "; ".join(f"{r['key']} {r['spread']}" for r in rows) + ".",
        "- collectives / bytes moved: forward collectives executed by one rank, and the summed size"
        " of that rank's input tensor to each (tpcompile: `tpcompile.collectives.record()`;"
        " hand-written: its own call log). Identical on every rank.",
        "- parameter bytes: distinct parameter storages the rank's module holds (tied weights once).",
        f"- Correctness: max abs difference of each rank's logits from the unsharded logits:"
        f" tpcompile {checks['tpcompile']:.2e}, hand-written {checks['hand-written']:.2e}"
        f" (limit {TOLERANCE:g}).",
        f"- tpcompile's static forward collective list (rank 0's graph): {len(static)} ops, "
        + _fmt_counts(_count([(op, 0) for op, _ in static])[0]) + ".",
        f"- Compute-only reference: the hand-written rank with its collectives replaced by local"
        f" no-ops (all {ws} ranks at once) takes {compute_ms:.2f} ms per forward, so about"
        f" {hand_ms - compute_ms:.0f} ms of the hand-written forward is gloo communication over"
        " loopback and waiting between ranks. The rank processes share this machine's cores,"
        " caches and memory bandwidth (and anything else running on it), so timings are noisy.",
        f"- Wall time of the whole run: {wall_s:.0f} s.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, write the report and print its table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    ap.add_argument("--iters", type=int, default=ITERS, help="timed forwards per variant")
    args = ap.parse_args(argv)
    ws = args.world_size
    wall = time.perf_counter()
    model = build_model()
    idx = token_ids()
    with torch.no_grad():
        ref = model(idx)
    base_times = time_unsharded(model, idx, args.iters)
    results = launch(ws, rank_main, ws, model.state_dict(), idx, ref, args.iters, timeout=300)

    checks: dict[str, float] = {}
    rows = [{"key": "unsharded", "variant": "unsharded (1 process)", "ms": 1e3 * statistics.median(base_times),
             "spread": _spread(base_times),
             "collectives": "none", "bytes": "0", "params": _fmt_bytes(parameter_bytes(model))}]
    for name in ("tpcompile", "hand-written"):
        per_rank = [r[name] for r in results]
        checks[name] = max(r["diff"] for r in per_rank)
        if any(r["counts"] != per_rank[0]["counts"] or r["bytes"] != per_rank[0]["bytes"]
               for r in per_rank):
            raise SystemExit(f"{name}: ranks disagree on their collectives: {per_rank}")
        # Every rank reports the same slowest-rank times; rank 0's list is the run's.
        rows.append({"key": name, "variant": f"{name} (rank of {ws})", "ms": 1e3 * statistics.median(per_rank[0]["times"]),
                     "spread": _spread(per_rank[0]["times"]),
                     "collectives": _fmt_counts(per_rank[0]["counts"]), "bytes": _fmt_bytes(per_rank[0]["bytes"]),
                     "params": _fmt_bytes(max(r["param_bytes"] for r in per_rank))})
    for name, diff in checks.items():
        if not diff <= TOLERANCE:
            raise SystemExit(f"{name}: logits differ from the unsharded model by {diff:.3e} > {TOLERANCE:g}")
    compute_ms = 1e3 * statistics.median(results[0]["compute_only"])
    text = render(ws, args.iters, rows, checks, results[0]["static_collectives"], compute_ms,
                  time.perf_counter() - wall)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print("\n".join(line for line in text.splitlines() if line.startswith("|")))
    print(f"\nshard() + rank() took {max(r['shard_s'] for r in results):.1f} s per process; "
          f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
