"""Generation with a key/value cache on sharded ranks: `shard_generation` -> ShardedGenerator (docs/generate.md).

    cache.py      CachedLM: the model and a static cache (buffers written with index_copy_)
    hf.py, gpt.py how a Hugging Face *ForCausalLM and the bundled GPT run with that cache
    masks.py      which cached positions each new token sees (padding, causality, sliding windows)
    capture.py    one graph for prefill and decode, sharded by the compiler (the cache by heads)
    generator.py  ShardedGenerator, and each rank's generate loop
    sampling.py   the next token: greedy, or temperature / top-k / top-p with a shared seed
"""
from __future__ import annotations

from typing import Any

from torch import nn

from tpcompile.generate.capture import capture_generation
from tpcompile.generate.generator import GenerationStats, RankGenerator, ShardedGenerator

__all__ = ["GenerationStats", "RankGenerator", "ShardedGenerator", "shard_generation"]


def shard_generation(model: nn.Module, world_size: int, *, max_seq_len: int, max_batch_size: int = 1,
                     plan: Any = None, group: Any = "default") -> ShardedGenerator:
    """Shard a decoder-only language model for generation with a key/value cache split by heads.

    `model` is a Hugging Face *ForCausalLM or the bundled GPT. The cache holds up to
    `max_batch_size` prompts of `max_seq_len` tokens (prompt plus new tokens); `plan` and `group`
    are those of tpcompile.shard (plan paths are paths in `model`). `.rank(r).generate(...)` runs
    rank r, in the simulator (tpcompile.simulate_ranks) or in a torchrun process.
    """
    sm, spec = capture_generation(model, world_size, max_seq_len=max_seq_len, max_batch_size=max_batch_size,
                                  plan=plan, group=group)
    sm.model_name = type(model).__name__
    return ShardedGenerator(sm, spec)
