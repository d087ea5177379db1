"""One process of the generation bench: the unsharded model, tpcompile, or Hugging Face's tp_plan="auto".

    python bench/generate_rank.py --contender unsharded --model-dir DIR --out FILE
    torchrun --nproc-per-node 2 bench/generate_rank.py --contender tpcompile --model-dir DIR --out FILE
    torchrun --nproc-per-node 2 bench/generate_rank.py --contender hf-tp --model-dir DIR --out FILE

Each process loads the same saved model, generates --new-tokens greedily for one prompt --repeats
times after one warm-up call, and rank 0 writes what it measured as JSON: the tokens, the time to
the first token, each decode step's time, tokens per second over whole calls, the cache bytes it holds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from typing import Any, Callable

import torch


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


def _hf_run(model: Any, ids: torch.Tensor, mask: torch.Tensor, new: int) -> dict:
    """One greedy generate call of a Hugging Face model, timed token by token."""
    stamps = _Stamps()
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         streamer=stamps, return_dict_in_generate=True)
    total = time.perf_counter() - start
    t = stamps.times
    cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
    return {"tokens": out.sequences[0, ids.shape[1]:].tolist(), "first_s": t[1] - start,
            "decode_s": [b - a for a, b in zip(t[1:], t[2:])], "total_s": total, "cache_bytes": _cache_bytes(cache)}


def _tpcompile_runner(model: Any, rank: int, world: int, max_seq_len: int) -> tuple[Callable, dict]:
    """A run function for this rank's generator, and what sharding cost."""
    import tpcompile
    start = time.perf_counter()
    gen = tpcompile.shard_generation(model, world, max_seq_len=max_seq_len)
    local = gen.rank(rank)
    setup = {"shard_s": time.perf_counter() - start, "cache_bytes": gen.cache_bytes(rank),
             "cache_bytes_unsharded": gen.unsharded_cache_bytes}

    def run(ids: torch.Tensor, mask: torch.Tensor, new: int) -> dict:
        start = time.perf_counter()
        out = local.generate(ids, attention_mask=mask, max_new_tokens=new)
        total = time.perf_counter() - start
        s = local.stats
        return {"tokens": out[0, ids.shape[1]:].tolist(), "first_s": s.prefill_s, "decode_s": list(s.decode_s),
                "total_s": total, "cache_bytes": setup["cache_bytes"]}
    return run, setup


def main() -> None:
    """Load, warm up, measure, and write rank 0's JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contender", choices=("unsharded", "tpcompile", "hf-tp"), required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", required=True)
    opts = ap.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # transformers' deprecation notes and tpcompile's replication notes
    import transformers

    from tpcompile.generate.reference import example_prompts
    transformers.logging.set_verbosity_error()
    rank, world = 0, 1
    kwargs: dict[str, Any] = {}
    if opts.contender != "unsharded":
        from tpcompile.runtime import init_from_env
        rank, world = init_from_env("gloo")
    if opts.contender == "hf-tp":
        kwargs["tp_plan"] = "auto"  # Hugging Face's own tensor parallelism (DTensor), on the launch's group
    model = transformers.AutoModelForCausalLM.from_pretrained(opts.model_dir, **kwargs).eval()
    ids, mask = example_prompts(model.config.vocab_size, 1, opts.prompt_len)
    setup: dict = {}
    if opts.contender == "tpcompile":
        run, setup = _tpcompile_runner(model, rank, world, opts.prompt_len + opts.new_tokens)
    else:
        def run(ids: torch.Tensor, mask: torch.Tensor, new: int) -> dict:
            return _hf_run(model, ids, mask, new)
    with torch.no_grad():
        run(ids, mask, opts.new_tokens)  # warm-up: first-call costs (allocation, guards) are not per token
        runs = [run(ids, mask, opts.new_tokens) for _ in range(opts.repeats)]
    steps = [d for r in runs for d in r["decode_s"]]
    result = {"contender": opts.contender, "world_size": world, "tokens": runs[0]["tokens"],
              "same_on_every_run": all(r["tokens"] == runs[0]["tokens"] for r in runs),
              "first_token_ms": 1e3 * statistics.median(r["first_s"] for r in runs),
              "decode_ms": 1e3 * statistics.median(steps), "decode_ms_q1_q3": [1e3 * q for q in _quartiles(steps)],
              "tokens_per_s": statistics.median(opts.new_tokens / r["total_s"] for r in runs),
              "cache_bytes_per_rank": runs[-1]["cache_bytes"], **setup}
    if rank == 0:
        with open(opts.out, "w") as f:
            json.dump(result, f)
    if world > 1:
        import torch.distributed as dist
        dist.barrier()
        dist.destroy_process_group()


def _quartiles(values: list[float]) -> list[float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return [q[0], q[2]]


if __name__ == "__main__":
    main()
