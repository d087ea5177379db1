"""shard() time split into capture (torch.export) and passes, for a Llama-2-7B-shaped model on the meta device."""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch

import tpcompile

__all__ = ["LLAMA_7B", "measure_compile_time"]

# Llama-2-7B's shape; only the depth varies.
LLAMA_7B = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=32, intermediate_size=11008,
                vocab_size=32000)


def _once(layers: int, world_size: int, shape: dict) -> dict[str, float]:
    """One shard() of a meta-device LlamaForCausalLM with `layers` layers, and rank 0's rewrite."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(**shape, num_hidden_layers=layers, use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).eval()
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sm = tpcompile.shard(model, world_size, example_kwargs={"input_ids": ids, "use_cache": False})
        start = time.perf_counter()
        gm = sm.rank(0)
        rewrite_s = time.perf_counter() - start
    nodes = sum(1 for _ in sm.captured.graph.nodes)
    return {"capture_s": sm.timings["capture_s"], "passes_s": sm.timings["passes_s"], "rewrite_s": rewrite_s,
            "nodes": nodes, "collectives": len(sm.collectives()), "rank_nodes": sum(1 for _ in gm.graph.nodes)}


def measure_compile_time(layers: tuple[int, ...], world_size: int, repeats: int,
                         shape: dict | None = None) -> dict[str, Any]:
    """Per depth the fastest of `repeats` runs of each part (the machine is shared: minima are stable)."""
    shape = dict(LLAMA_7B if shape is None else shape)
    rows = []
    for n in layers:
        runs = [_once(n, world_size, shape) for _ in range(repeats)]
        best = {k: min(r[k] for r in runs) for k in ("capture_s", "passes_s", "rewrite_s")}
        rows.append({"layers": n, **best, "nodes": runs[0]["nodes"], "rank_nodes": runs[0]["rank_nodes"],
                     "collectives": runs[0]["collectives"], "runs": runs})
    return {"shape": shape, "world_size": world_size, "repeats": repeats, "rows": rows}
