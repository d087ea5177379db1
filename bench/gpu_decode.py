"""The one-GPU check's decode part: tokens/s of a 1B-shaped Llama and its fraction of the bandwidth roofline.

A Llama of Llama-3.2-1B's shape (16 layers, width 2048, 32 heads, 8 kv heads, vocabulary 128256,
tied embeddings; random weights) is built on the device in bf16 and generates greedily at world
size 1 through tpcompile.shard_generation: with the decode step captured as CUDA graphs (the
default on a GPU), eagerly, and as Hugging Face's own generate. A decode step must read every
weight once (the tied table once, by the head) and the keys and values cached so far; that
many bytes per token over the measured copy bandwidth is the roofline.
"""
from __future__ import annotations

import statistics
import time
import warnings
from typing import Any

import torch

from bench.gpu_parts import H200_NOMINAL_BYTES_PER_S, Setup, sync

LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=4096, tie_word_embeddings=True)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=128, tie_word_embeddings=True)
SIZES = {"full": (128, 256, 3), "dry": (8, 12, 1)}  # prompt tokens, new tokens, timed calls


def build_llama(cfg: dict, device: torch.device) -> torch.nn.Module:
    """A random LlamaForCausalLM of this shape, built on the device, in bf16, seed 0."""
    import transformers
    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(**cfg, bos_token_id=None, eos_token_id=None, pad_token_id=0,
                                      attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    return model.to(torch.bfloat16).eval()


def bytes_per_token(model: torch.nn.Module, filled: float) -> dict:
    """What a decode step must read: every weight once (a lookup reads one row of the token table, a tied table
    is read whole by the head) and the keys and values of `filled` cached positions."""
    c = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    table = model.get_input_embeddings().weight
    if model.get_output_embeddings().weight is not table:
        weights -= table.numel() * table.element_size()
    head_dim = c.hidden_size // c.num_attention_heads
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * table.element_size() * filled
    return {"weights": weights, "kv_cache": kv, "total": weights + kv}


def _generate(local: Any, ids: torch.Tensor, new: int, device: torch.device) -> dict:
    """One timed greedy call of a tpcompile rank generator."""
    sync(device)
    start = time.perf_counter()
    out = local.generate(ids, max_new_tokens=new, eos_token_id=[])
    sync(device)
    total = time.perf_counter() - start
    return {"tokens": out[0, ids.shape[1]:].tolist(), "total_s": total, "first_token_s": local.stats.first_token_s,
            "step_s": statistics.median(local.stats.decode_s)}


def _summary(runs: list[dict], new: int) -> dict:
    steps = [r["step_s"] for r in runs]
    return {"decode_ms_per_token": 1e3 * statistics.median(steps), "decode_tokens_per_s": 1 / statistics.median(steps),
            "call_tokens_per_s": statistics.median(new / r["total_s"] for r in runs),
            "first_token_ms": 1e3 * statistics.median(r["first_token_s"] for r in runs), "calls": len(runs)}


def decode(s: Setup) -> dict:
    """Greedy decode at world size 1: CUDA graphs, eager, and HF generate; the roofline fraction."""
    import tpcompile
    prompt, new, calls = SIZES["dry" if s.dry else "full"]
    model = build_llama(TINY if s.dry else LLAMA_1B, s.device)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(3))
    ids = ids.to(s.device)
    start = time.perf_counter()
    gen = tpcompile.shard_generation(model, 1, max_seq_len=prompt + new)
    local = gen.rank(0)
    out: dict[str, Any] = {"prompt": prompt, "new_tokens": new, "shard_s": time.perf_counter() - start,
                           "parameters": sum(p.numel() for p in model.parameters())}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["warm_up_s"] = _generate(local, ids, new, s.device)["total_s"]  # captures a CUDA graph per length
        graphs = [_generate(local, ids, new, s.device) for _ in range(calls)]
    fell_back = [str(w.message) for w in caught if "CUDA graph" in str(w.message)]
    local.cuda_graphs = False
    eager = [_generate(local, ids, new, s.device) for _ in range(max(1, calls - 1))]
    out["tpcompile"] = _summary(graphs, new)
    out["tpcompile_eager"] = _summary(eager, new)
    out["cuda_graphs"] = s.device.type == "cuda" and not fell_back
    out["cuda_graph_fallback"] = fell_back[:1]
    out["graphs_equal_eager"] = graphs[0]["tokens"] == eager[0]["tokens"]
    sync(s.device)
    start = time.perf_counter()
    with torch.no_grad():
        hf = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    sync(s.device)
    hf_tokens = hf[0, prompt:].tolist()
    same = next((i for i, (a, b) in enumerate(zip(hf_tokens, graphs[0]["tokens"])) if a != b), len(hf_tokens))
    out["hf_generate"] = {"call_tokens_per_s": new / (time.perf_counter() - start), "leading_tokens_equal": same}
    need = bytes_per_token(model, filled=prompt + new / 2)  # decode positions prompt .. prompt + new - 2
    rate = out["tpcompile"]["decode_tokens_per_s"]
    measured = s.bandwidth or float("nan")
    out["roofline"] = {"bytes_per_token": need, "bandwidth_bytes_per_s": measured,
                       "tokens_per_s": measured / need["total"], "fraction": rate * need["total"] / measured,
                       "nominal_bytes_per_s": H200_NOMINAL_BYTES_PER_S,
                       "fraction_of_nominal": rate * need["total"] / H200_NOMINAL_BYTES_PER_S}
    out["ok"] = out["graphs_equal_eager"] and rate > 0 and (s.device.type != "cuda" or out["cuda_graphs"])
    return out
