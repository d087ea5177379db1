"""One rank of the generation bench: every contender in one process group, interleaved repetitions.

    torchrun --nproc-per-node 2 bench/generate_rank.py --model-dir DIR --out FILE [--repeats R]

Each rank loads the saved model three times: the unsharded model (run on rank 0 alone while the
other ranks wait in a barrier), tpcompile.shard_generation's rank, and Hugging Face's
`from_pretrained(..., tp_plan="auto")`. After one warm-up call of each, every repetition probes the
latency of one small all-reduce between busy ranks and times one greedy generate call per
contender, in an order rotated each repetition, so that all of them see the same load on the
machine. Rank 0 writes every repetition's numbers as JSON (bench/generate.py summarises them).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist

CONTENDERS = ("unsharded", "tpcompile", "hf-tp")
PROBE_ITERS = 10  # passes over every block per latency probe, with and without the all-reduces


class _Stamps:
    """A generate() streamer that notes when each token arrives (the prompt first, then every new token)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _cache_bytes(cache: Any) -> int:
    """Bytes of the keys and values a Hugging Face cache holds on this rank (a DTensor's local part)."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (layer.keys, layer.values):
            t = t.to_local() if hasattr(t, "to_local") else t
            total += t.numel() * t.element_size()
    return total


def hf_runner(model: Any) -> Callable[[torch.Tensor, torch.Tensor, int], dict]:
    """A run function for a Hugging Face model's greedy generate, timed token by token."""
    def run(ids: torch.Tensor, mask: torch.Tensor, new: int) -> dict:
        stamps = _Stamps()
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             streamer=stamps, return_dict_in_generate=True)
        total = time.perf_counter() - start
        t = stamps.times
        cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
        return {"tokens": out.sequences[0, ids.shape[1]:].tolist(), "first_s": t[1] - start,
                "decode_s": [b - a for a, b in zip(t[1:], t[2:])], "total_s": total, "cache_bytes": _cache_bytes(cache)}
    return run


def tpcompile_runner(model: Any, rank: int, world: int, max_seq_len: int) -> tuple[Callable, dict]:
    """A run function for this rank's tpcompile generator, and what sharding cost."""
    import tpcompile
    from tpcompile.ops.collectives import record
    start = time.perf_counter()
    gen = tpcompile.shard_generation(model, world, max_seq_len=max_seq_len)
    local = gen.rank(rank)
    setup = {"shard_s": time.perf_counter() - start, "cache_bytes": gen.cache_bytes(rank),
             "cache_bytes_unsharded": gen.unsharded_cache_bytes}

    def run(ids: torch.Tensor, mask: torch.Tensor, new: int) -> dict:
        start = time.perf_counter()
        out = local.generate(ids, attention_mask=mask, max_new_tokens=new, eos_token_id=[])
        total = time.perf_counter() - start
        s = local.stats
        return {"tokens": out[0, ids.shape[1]:].tolist(), "first_s": s.first_token_s, "decode_s": list(s.decode_s),
                "total_s": total, "cache_bytes": setup["cache_bytes"]}

    ids = torch.zeros(1, 2, dtype=torch.long)
    with record() as events:  # one prefill and one decode step: the collectives of each step
        local.generate(ids, max_new_tokens=2, eos_token_id=[])
    mine = [e.op for e in events if e.rank == rank]
    setup["collectives_per_step"] = len(mine) // 2
    setup["collective_ops"] = sorted(set(mine))
    return run, setup


def busy_latency(config: Any, world: int) -> dict:
    """Seconds one small all-reduce adds between busy ranks. Each rank runs its share of every block's matmuls
    for one token, with weights of the model's sizes (read from memory as a decode step reads them): the
    attention's (q, k, v, o) then the MLP's (gate, up, down), each followed by an all-reduce of one token's
    hidden state, as a decode step does; the same matmuls alone are subtracted."""
    hidden, inner = config.hidden_size, config.intermediate_size // world
    kv = hidden * config.num_key_value_heads // config.num_attention_heads // world
    x = torch.randn(1, hidden)
    shapes = ((hidden, hidden // world), (hidden, kv), (hidden, kv), (hidden // world, hidden), (hidden, inner),
              (hidden, inner), (inner, hidden))
    blocks = [[torch.randn(*shape) for shape in shapes] for _ in range(config.num_hidden_layers)]
    flag = torch.zeros(1, 1, hidden)

    def step(with_reduce: bool) -> None:
        for q, k, v, o, gate, up, down in blocks:
            x @ k, x @ v
            (x @ q) @ o
            if with_reduce:
                dist.all_reduce(flag)
            ((x @ gate) * (x @ up)) @ down
            if with_reduce:
                dist.all_reduce(flag)

    def timed(with_reduce: bool) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(PROBE_ITERS):
            step(with_reduce)
        return (time.perf_counter() - start) / PROBE_ITERS

    alone, chained = timed(False), timed(True)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(PROBE_ITERS):
        dist.all_reduce(flag)
    idle = (time.perf_counter() - start) / PROBE_ITERS
    reductions = 2 * len(blocks)
    return {"matmuls_s": alone, "matmuls_and_all_reduces_s": chained,
            "busy_s": max(chained - alone, 0.0) / reductions, "idle_s": idle}


def _slowest(seconds: float) -> float:
    """The largest of every rank's value."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def build(names: tuple[str, ...], model_dir: str, rank: int, world: int, max_seq_len: int) -> tuple[dict, dict]:
    """Each contender's run function (or the error it failed with) and what setting it up measured."""
    import transformers
    runners: dict[str, Any] = {}
    setup: dict[str, dict] = {}
    for name in names:
        start = time.perf_counter()
        try:
            if name == "hf-tp":  # Hugging Face's own tensor parallelism (DTensor) on this process group
                model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto").eval()
                runners[name], setup[name] = hf_runner(model), {}
            else:
                model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
                if name == "tpcompile":
                    runners[name], setup[name] = tpcompile_runner(model, rank, world, max_seq_len)
                else:
                    runners[name], setup[name] = hf_runner(model), {}
            setup[name]["load_s"] = time.perf_counter() - start
        except Exception as e:  # noqa: BLE001  reported in the table, the other contenders still run
            last = traceback.extract_tb(e.__traceback__)[-1]
            runners[name] = f"{type(e).__name__}: {e} (at {os.path.basename(last.filename)}:{last.lineno})"
            setup[name] = {}
    return runners, setup


def main() -> None:
    """Load, warm up, measure every repetition, and write rank 0's JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", required=True)
    opts = ap.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # transformers' deprecation notes and tpcompile's replication notes
    import transformers

    from tpcompile.generate.reference import example_prompts
    from tpcompile.runtime import init_from_env
    transformers.logging.set_verbosity_error()
    rank, world = init_from_env("gloo")
    names = tuple(n for n in opts.contenders.split(",") if n)
    runners, setup = build(names, opts.model_dir, rank, world, opts.prompt_len + opts.new_tokens)
    config = transformers.AutoConfig.from_pretrained(opts.model_dir)
    ids, mask = example_prompts(config.vocab_size, 1, opts.prompt_len)
    live = [n for n in names if callable(runners[n])]
    reps: list[dict] = []
    with torch.no_grad():
        for i in range(opts.repeats + 1):  # the first round warms every contender up and is not kept
            rep: dict[str, Any] = {"latency": busy_latency(config, world)}
            for name in live[i % len(live):] + live[:i % len(live)]:
                dist.barrier()
                if name == "unsharded" and rank != 0:  # one process: the other ranks leave it the machine
                    continue
                rep[name] = runners[name](ids, mask, opts.new_tokens)
            dist.barrier()
            rep["latency"]["busy_s"] = _slowest(rep["latency"]["busy_s"])
            if i:
                reps.append(rep)
    if rank == 0:
        result = {"world_size": world, "contenders": list(names), "setup": setup,
                  "errors": {n: r for n, r in runners.items() if not callable(r)}, "repetitions": reps,
                  "summary": {n: _summary([r[n] for r in reps]) for n in live}}
        with open(opts.out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def _summary(runs: list[dict]) -> dict:
    """Medians over repetitions: time to first token, per-step decode time, tokens/s; the tokens."""
    steps = [d for r in runs for d in r["decode_s"]]
    q = statistics.quantiles(steps, n=4) if len(steps) > 1 else [steps[0]] * 3
    return {"tokens": runs[0]["tokens"], "same_on_every_run": all(r["tokens"] == runs[0]["tokens"] for r in runs),
            "first_token_ms": 1e3 * statistics.median(r["first_s"] for r in runs),
            "decode_ms": 1e3 * statistics.median(statistics.median(r["decode_s"]) for r in runs),
            "decode_ms_q1_q3": [1e3 * q[0], 1e3 * q[2]],
            "tokens_per_s": statistics.median(len(r["tokens"]) / r["total_s"] for r in runs),
            "cache_bytes_per_rank": runs[-1]["cache_bytes"]}


if __name__ == "__main__":
    main()
