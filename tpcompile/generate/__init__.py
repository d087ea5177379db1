"""Generation with a key/value cache on sharded ranks: `shard_generation` -> ShardedGenerator (docs/generate.md).

    cache.py      CachedLM: the model and a static cache (buffers written with index_copy_)
    hf.py, gpt.py how a Hugging Face *ForCausalLM and the bundled GPT run with that cache
    masks.py      which cached positions each new token sees (padding, causality, sliding windows)
    capture.py    one graph for prefill and decode, sharded by the compiler (the cache by heads)
    generator.py  ShardedGenerator, and each rank's generator (its arguments checked)
    decode.py     the generate loop: the prompt, then one token per step from inputs kept on the device
    inference.py  the rank graph trimmed for that loop (no guards, checks or gradient markers)
    sampling.py   the next token: greedy, or sampled from a seed shared by every rank
    locality.py   attention locality from the model's config: sliding windows, chunks, or a refusal
    processors.py the model's generation_config: transformers' own logits processors, or a refusal
    support.py    architectures refused with their reason, and a probe against the model's own generate
    loading.py    weights= for a model built on the meta device: each rank reads only its slices
"""
from __future__ import annotations

from typing import Any

from torch import nn

from tpcompile.errors import TPCompileError
from tpcompile.generate.capture import capture_generation
from tpcompile.generate.generator import GenerationStats, RankGenerator, ShardedGenerator
from tpcompile.runtime.agreement import agree_program, agree_state, distributed, process_group
from tpcompile.runtime.fingerprint import graph_lines, plan_lines
from tpcompile.runtime.input_check import InputCheck, check_inputs_mode

ENTRY = "tpcompile.shard_generation"

__all__ = ["GenerationStats", "RankGenerator", "ShardedGenerator", "shard_generation"]


def shard_generation(model: nn.Module, world_size: int, *, max_seq_len: int, max_batch_size: int = 1,
                     plan: Any = None, group: Any = "default", check: bool = True,
                     check_inputs: str = "first", weights: Any = None, device: Any = None) -> ShardedGenerator:
    """Shard a decoder-only language model for generation with a key/value cache split by heads.

    `model` is a Hugging Face *ForCausalLM or the bundled GPT. The cache holds up to
    `max_batch_size` prompts of `max_seq_len` tokens (prompt plus new tokens); `plan` and `group`
    are those of tpcompile.shard (plan paths are paths in `model`). `.rank(r).generate(...)` runs
    rank r, in the simulator (tpcompile.simulate_ranks) or in a torchrun process. Under a running
    process group of `world_size` ranks, `check` runs the startup agreement (runtime/agreement.py) and
    `check_inputs` compares each rank's generate() arguments ("first" call, "always", "never").
    A model built under `torch.device("meta")` needs `weights` (a full state dict, .safetensors or .pt files, or a
    directory of them, named as in `model`): each rank then reads only its slices when it is built, onto `device`
    (default: cuda:LOCAL_RANK under NCCL, else the CPU). The model's generation_config applies as in generate
    (generate/processors.py); attention locality follows its config (generate/locality.py); fields and
    architectures that cannot be honoured raise a TPCompileError here.
    """
    check_inputs_mode(check_inputs)
    if weights is None and any(t.is_meta for t in list(model.parameters()) + list(model.buffers())):
        raise TPCompileError(f"{type(model).__name__} is on the meta device, so shard_generation needs weights= (a "
                             f"state dict, .safetensors files, or a directory of them)")
    pg = process_group(group, world_size)
    if check and distributed(pg):  # before capture: other tensors raise, other values are replaced by rank 0's
        named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
        agree_state(named, pg, values=not any(t.is_meta for _, t in named), entry=ENTRY)
    sm, spec = capture_generation(model, world_size, max_seq_len=max_seq_len, max_batch_size=max_batch_size,
                                  plan=plan, group=group)
    sm.model_name = type(model).__name__
    if check and distributed(pg):
        options = [f"world_size={world_size}", f"max_seq_len={max_seq_len}", f"max_batch_size={max_batch_size}"]
        agree_program(graph_lines(sm.captured), plan_lines(sm.plan, sm.overrides, options), None, pg,
                      entry=ENTRY)
    checker = InputCheck(pg, mode=check_inputs, where="RankGenerator.generate") if distributed(pg) else None
    return ShardedGenerator(sm, spec, input_check=checker, weights=weights, device=device)
