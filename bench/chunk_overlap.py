"""`python -m bench.chunk_overlap`: would splitting a row-parallel matmul by tokens, and all-reducing each
chunk while the next one computes, beat the whole matmul and one all-reduce on this machine?

Plain torch.distributed on 2 gloo ranks, one thread each: y = x @ w.T for x (512 x 1024) and w (256 x 1024),
then y summed over the ranks, whole (synchronous) or in 2 and 4 token chunks (each chunk's all-reduce started
asynchronously as soon as it is computed, all waited for at the end, then concatenated). Prints the median
time of each and its median ratio to the whole, over 60 rounds of 5 calls, the order alternating.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from tpcompile.runtime.launch import launch


def _rank(rank: int) -> dict:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(rank)
    x, w = torch.randn(512, 1024, generator=g), torch.randn(256, 1024, generator=g)

    def whole() -> torch.Tensor:
        y = x @ w.T
        dist.all_reduce(y)
        return y

    def chunked(k: int) -> torch.Tensor:
        ys: list[torch.Tensor] = []
        works = []
        for c in x.chunk(k, 0):
            ys.append(c @ w.T)
            works.append(dist.all_reduce(ys[-1], async_op=True))
        for work in works:
            work.wait()
        return torch.cat(ys, 0)

    fns = {"whole": whole, "2 chunks": lambda: chunked(2), "4 chunks": lambda: chunked(4)}
    diff = max(float((f() - whole()).abs().max()) for f in fns.values())
    times: dict[str, list[float]] = {k: [] for k in fns}
    for rnd in range(60):
        for k in (list(fns) if rnd % 2 else list(fns)[::-1]):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(5):
                fns[k]()
            times[k].append((time.perf_counter() - start) / 5)
    return {"diff": diff, "times": times}


def main() -> int:
    res = launch(2, _rank, timeout=600)[0]
    whole = res["times"]["whole"]
    for k, ts in res["times"].items():
        ratio = statistics.median(t / w for t, w in zip(ts, whole))
        print(f"{k:9s} {1e3 * statistics.median(ts):7.3f} ms   ratio to whole {ratio:.3f}")
    print(f"max difference from the whole all-reduce: {res['diff']:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
