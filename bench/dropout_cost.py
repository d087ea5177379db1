"""What one dropout costs on attention probabilities: tpcompile's position-hash mask against a generator mask.

`python bench/dropout_cost.py [--shape 8,16,512,512] [--threads 1] [--rounds 7]` times x * mask for a
float32 tensor, p = 0.1: tpcompile's mask (torch.ops.tpcompile_rng.dropout_mask, the hash of each
element's global position, ops/rng_hash.py) and a mask drawn from a seeded torch.Generator (uniform_,
compare, scale: what tpcompile drew before its masks became layout-independent). The contenders take
turns in every round; the fastest and the median round are printed, with a plain x * 1.25 for scale.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Callable

import torch

import tpcompile.ops.rng as rng


def _contenders(x: torch.Tensor, p: float) -> dict[str, Callable[[], torch.Tensor]]:
    """name -> a function computing x times its mask."""
    gen = torch.Generator().manual_seed(0)
    op = torch.ops.tpcompile_rng.dropout_mask.default
    shape = list(x.shape)

    def generator() -> torch.Tensor:
        keep = torch.empty(x.shape, dtype=torch.float32).uniform_(0.0, 1.0, generator=gen) >= p
        return x * (keep.to(x.dtype) / (1.0 - p))

    def position_hash() -> torch.Tensor:
        with rng.step(0):
            return x * op(x, p, "bench", 0, [], [0] * len(shape), 0)
    return {"position hash": position_hash, "generator": generator, "x * 1.25": lambda: x * 1.25}


def main() -> None:
    """Time the contenders and print one line each (or one JSON object with --json)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="8,16,512,512")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    x = torch.rand([int(s) for s in args.shape.split(",")])
    runs = _contenders(x, 0.1)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, fn in runs.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    result = {name: {"min_ms": round(min(t) * 1e3, 1), "median_ms": round(statistics.median(t) * 1e3, 1)}
              for name, t in times.items()}
    result["load_average"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(result))
        return
    print(f"dropout (p=0.1) on a float32 {tuple(x.shape)} tensor, {args.threads} thread(s), {args.rounds} rounds, "
          f"torch {torch.__version__}, load average {result['load_average']:.1f}")
    for name in runs:
        print(f"  {name:14s} fastest {result[name]['min_ms']:8.1f} ms   median {result[name]['median_ms']:8.1f} ms")


if __name__ == "__main__":
    main()
