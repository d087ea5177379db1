"""ShardedGenerator and each rank's generate loop: prefill the prompt, then one token per step.

A rank runs its graph on the whole (left-padded) prompt, which fills its heads of the cache and
gives the first new token, then on one token per step. Every step's inputs (token, position,
cache position, masks) are built alike on every rank; the logits come back whole on every rank,
so each rank chooses the same token without further communication. The loop follows Hugging Face
generate: positions from the attention mask's running count, finished rows padded after their
end-of-sequence token, the loop ending when every row has finished.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import torch
from torch.fx import GraphModule

from tpcompile.api import ShardedModel
from tpcompile.errors import TPCompileError
from tpcompile.generate.capture import CACHE_PREFIX, GenerationSpec
from tpcompile.generate.masks import step_masks
from tpcompile.generate.sampling import Sampling, next_tokens


@dataclass
class GenerationStats:
    """Times of the last generate call on this rank: prefill (time to first token) and each decode step."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second over the whole call (rows of a batch counted once)."""
        total = self.prefill_s + sum(self.decode_s)
        return self.new_tokens / total if total > 0 else 0.0


class RankGenerator:
    """One rank's graph and cache; `generate` returns prompt + new tokens, as Hugging Face generate does."""

    def __init__(self, module: GraphModule, spec: GenerationSpec, rank: int, world_size: int) -> None:
        self.module, self.spec, self.rank, self.world_size = module, spec, rank, world_size
        self.stats = GenerationStats()
        self._device = next((b.device for b in module.buffers()), torch.device("cpu"))

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, *, max_new_tokens: int, attention_mask: Optional[torch.Tensor] = None,
                 do_sample: bool = False, temperature: float = 1.0, top_k: Optional[int] = None,
                 top_p: Optional[float] = None, eos_token_id: Union[int, Sequence[int], None] = None,
                 seed: Optional[int] = None) -> torch.LongTensor:
        """(B, P) prompt ids (left-padded, with attention_mask) -> (B, P + n) ids, n <= max_new_tokens."""
        ids, mask = self._check(input_ids, attention_mask, max_new_tokens)
        how = Sampling(bool(do_sample), temperature, top_k, top_p).check()
        eos = self._eos(eos_token_id)
        pad = self.spec.pad if self.spec.pad is not None else (eos[0] if eos else 0)
        generator = self._generator(seed) if how.do_sample else None
        batch, prompt = ids.shape
        self.stats = GenerationStats(prompt_tokens=prompt)
        keep = torch.ones(batch, self.spec.max_seq_len, dtype=torch.bool, device=self._device)
        keep[:, :prompt] = mask.bool()
        position = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)  # as generate derives it
        cache_position = torch.arange(prompt, device=self._device)
        tokens, out = ids, [ids]
        unfinished = torch.ones(batch, dtype=torch.bool, device=self._device)
        eos_t = torch.tensor(eos, dtype=torch.long, device=self._device)
        for step in range(max_new_tokens):
            start = time.perf_counter()
            masks = step_masks(keep, cache_position, self.spec.windows, self.spec.mask_kind, self.spec.dtype)
            logits = self.module(tokens, position, cache_position, masks)
            chosen = next_tokens(logits, how, generator)
            (self.stats.decode_s.append if step else self._prefill)(time.perf_counter() - start)
            if eos:
                chosen = torch.where(unfinished, chosen, torch.full_like(chosen, pad))
                unfinished &= ~torch.isin(chosen, eos_t)
            out.append(chosen[:, None])
            self.stats.new_tokens += 1
            if not bool(unfinished.any()):
                break
            tokens, position = chosen[:, None], position[:, -1:] + 1
            cache_position = cache_position[-1:] + 1
        return torch.cat(out, dim=1)

    def _prefill(self, seconds: float) -> None:
        self.stats.prefill_s = seconds

    def _check(self, input_ids: Any, attention_mask: Any, max_new_tokens: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt and its mask as (B, P) tensors on this rank's device, within the cache's sizes."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
            got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise TPCompileError(f"input_ids must be a (batch, prompt length) tensor of token ids, got {got}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise TPCompileError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        batch, prompt = input_ids.shape
        spec = self.spec
        if batch > spec.max_batch_size or batch < 1:
            raise TPCompileError(f"input_ids holds {batch} prompts but the cache was built for max_batch_size="
                                 f"{spec.max_batch_size}; call shard_generation(..., max_batch_size={max(batch, 1)})")
        if prompt < 1 or prompt + max_new_tokens > spec.max_seq_len:
            raise TPCompileError(
                f"prompt length {prompt} + max_new_tokens {max_new_tokens} = {prompt + max_new_tokens} tokens exceed "
                f"the cache's max_seq_len={spec.max_seq_len}; call shard_generation(..., max_seq_len="
                f"{max(prompt + max_new_tokens, prompt)}) or ask for fewer new tokens")
        if spec.vocab_size is not None and (int(input_ids.min()) < 0 or int(input_ids.max()) >= spec.vocab_size):
            raise TPCompileError(f"input_ids holds ids outside the vocabulary [0, {spec.vocab_size}): min "
                                 f"{int(input_ids.min())}, max {int(input_ids.max())}")
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (batch, prompt):
            got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise TPCompileError(f"attention_mask must be a ({batch}, {prompt}) tensor like input_ids, got {got}")
        if prompt and bool((mask[:, -1] == 0).any()):
            raise TPCompileError("attention_mask has padding at the end of a prompt; pad prompts on the left "
                                 "(tokenizer.padding_side = 'left'), as generate expects for decoder-only models")
        return input_ids.to(self._device, torch.long), mask.to(self._device)

    def _eos(self, eos_token_id: Union[int, Sequence[int], None]) -> list[int]:
        """The ids that end a row: the argument, else the model's generation_config (as generate does)."""
        if eos_token_id is None:
            return list(self.spec.eos)
        ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise TPCompileError(f"eos_token_id must be an int or a list of ints, got {eos_token_id!r}")
        return ids

    def _generator(self, seed: Optional[int]) -> torch.Generator:
        """A generator seeded alike on every rank: `seed`, else a seed drawn on rank 0 and shared."""
        if seed is None:
            drawn = int(torch.randint(0, 2**62, ())) if self.rank == 0 else 0
            if self.world_size > 1:  # every rank must draw the same numbers: take rank 0's seed
                shared = torch.ops.tpcompile.all_reduce(torch.tensor([drawn], dtype=torch.long), self.spec.group)
                drawn = int(shared[0])
            seed = drawn
        return torch.Generator(device=self._device).manual_seed(int(seed))


# identity in forward, it communicates only in backward, which generation never runs
_GRADIENT_MARKERS = ("tpcompile::grad_all_reduce",)


def _for_inference(module: GraphModule) -> GraphModule:
    """The rank graph without its gradient markers (each costs a custom-op dispatch per call, for nothing here)."""
    markers = [n for n in module.graph.nodes if n.op == "call_function" and hasattr(n.target, "name")
               and n.target.name() in _GRADIENT_MARKERS]
    for node in markers:
        node.replace_all_uses_with(node.args[0])
        module.graph.erase_node(node)
    if markers:
        module.recompile()
    return module


class ShardedGenerator:
    """The captured model with its cache, sharded: `.rank(r)` is rank r's generator."""

    def __init__(self, sharded: ShardedModel, spec: GenerationSpec) -> None:
        self.sharded, self.spec = sharded, spec
        self.world_size = sharded.world_size
        self._ranks: dict[int, RankGenerator] = {}
        self._lock = threading.Lock()

    def rank(self, r: int) -> RankGenerator:
        """Rank r's generator (its graph built on first use; a process under torchrun builds only its own)."""
        module = self.sharded.rank(r)  # checks r
        with self._lock:
            if r not in self._ranks:
                self._ranks[r] = RankGenerator(_for_inference(module), self.spec, r, self.world_size)
            return self._ranks[r]

    def cache_bytes(self, r: int = 0) -> int:
        """Bytes of key/value cache rank r holds."""
        return sum(b.numel() * b.element_size() for name, b in self.sharded.rank(r).named_buffers()
                   if name.startswith(CACHE_PREFIX))

    @property
    def unsharded_cache_bytes(self) -> int:
        """Bytes of the whole cache, as one process would hold it."""
        return self.spec.unsharded_cache_bytes

    def __repr__(self) -> str:
        return f"ShardedGenerator({self.sharded.model_name}, world_size={self.world_size})"
