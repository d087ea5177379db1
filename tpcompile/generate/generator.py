"""ShardedGenerator and each rank's generator: the arguments checked, then the generate loop (decode.py).

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
from tpcompile.generate.decode import BUCKET, StepRunner, decode
from tpcompile.generate.inference import inference_module
from tpcompile.generate.loading import load_generation_rank
from tpcompile.generate.sampling import Sampling


class _Temperature(float):
    """The float 1.0 that also says "not given" (the contract's default, told apart from a caller's 1.0)."""


DEFAULT_TEMPERATURE = _Temperature(1.0)


@dataclass
class GenerationStats:
    """Times of the last generate call on this rank: prefill (time to first token) and each decode step."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    first_token_s: float = 0.0
    decode_s: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second over the whole call (rows of a batch counted once)."""
        total = self.prefill_s + sum(self.decode_s)
        return self.new_tokens / total if total > 0 else 0.0


class RankGenerator:
    """One rank's graph and cache; `generate` returns prompt + new tokens, as Hugging Face generate does."""

    def __init__(self, module: GraphModule, spec: GenerationSpec, rank: int, world_size: int,
                 input_check: Optional[Any] = None) -> None:
        self.module, self.spec, self.rank, self.world_size = module, spec, rank, world_size
        self.input_check = input_check  # the ranks' generate() arguments compared (runtime/input_check.py)
        self.stats = GenerationStats()
        self._device = next((b.device for b in module.buffers()), torch.device("cpu"))
        self.bucket = BUCKET  # attention reads the filled cache rounded up to a multiple of this many positions
        self.cuda_graphs = True  # on a CUDA device, each decode step length is captured once and replayed
        self._runners: dict[int, StepRunner] = {}  # per batch size: the decode step's inputs (and CUDA graphs)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, *, max_new_tokens: int, attention_mask: Optional[torch.Tensor] = None,
                 do_sample: bool = False, temperature: float = DEFAULT_TEMPERATURE, top_k: Optional[int] = None,
                 top_p: Optional[float] = None, eos_token_id: Union[int, Sequence[int], None] = None,
                 seed: Optional[int] = None, pad_token_id: Optional[int] = None) -> torch.LongTensor:
        """(B, P) prompt ids (left-padded, with attention_mask) -> (B, P + n) ids, n <= max_new_tokens; rows that
        end early are filled with pad_token_id (default: the model's pad token, else the first eos id), as HF's.
        Greedy unless do_sample=True; temperature is the call's (1.0 unless given); None for top_k or top_p: the
        model's generation_config decides, as in HF generate. Every other generation_config field applies."""
        called = time.perf_counter()
        if temperature is DEFAULT_TEMPERATURE:  # not given: the generation_config's, when it has one
            temperature = None
        ids, mask = self._check(input_ids, attention_mask, max_new_tokens)
        if self.input_check is not None:  # every rank must generate from the same prompts with the same options
            self.input_check((), dict(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                      do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                                      eos_token_id=eos_token_id, seed=seed, pad_token_id=pad_token_id))
        Sampling(bool(do_sample), temperature, top_k, top_p).check()
        given = None if eos_token_id is None else self._eos(eos_token_id)
        if pad_token_id is not None and (isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int)):
            raise TPCompileError(f"pad_token_id must be an int, got {pad_token_id!r}")
        how, eos, pad = self._how(ids, mask, max_new_tokens, do_sample, temperature, top_k, top_p, given,
                                  pad_token_id)
        generator = self._generator(seed) if how.do_sample else None
        self.stats = GenerationStats(prompt_tokens=ids.shape[1])
        return decode(self.module, self.spec, ids, mask, max_new_tokens, how, generator, eos, pad, self.stats,
                      called=called, runners=self._runners, bucket=self.bucket, cuda_graphs=self.cuda_graphs)

    def _how(self, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, do_sample: Optional[bool],
             temperature: Optional[float], top_k: Optional[int], top_p: Optional[float], eos: Optional[list[int]],
             pad_token_id: Optional[int]) -> tuple[Sampling, list[int], int]:
        """How to choose each token, the ids that end a row, and the id that fills it afterwards: a Hugging Face
        model's generation_config merged with the call's arguments (its logits processors, eos and pad ids, as
        generate prepares them), else temperature / top-k / top-p as given and the model's stop tokens."""
        decoding = self.spec.decoding
        if decoding is None:
            eos = list(self.spec.eos) if eos is None else eos
            pad = next(p for p in (pad_token_id, self.spec.pad, eos[0] if eos else 0) if p is not None)
            return Sampling(bool(do_sample), 1.0 if temperature is None else temperature, top_k, top_p), eos, pad
        done = decoding.prepare(ids, mask, max_new_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k,
                                top_p=top_p, eos_token_id=eos or None, pad_token_id=pad_token_id)
        eos = done.eos if eos is None else eos
        pad = next(p for p in (pad_token_id, done.pad, eos[0] if eos else 0) if p is not None)
        return Sampling(done.do_sample, processors=done.processors), eos, pad

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

    def _eos(self, eos_token_id: Union[int, Sequence[int]]) -> list[int]:
        """The ids that end a row, as the argument gives them (an int or a list of ints)."""
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


class ShardedGenerator:
    """The captured model with its cache, sharded: `.rank(r)` is rank r's generator."""

    def __init__(self, sharded: ShardedModel, spec: GenerationSpec, input_check: Optional[Any] = None,
                 weights: Optional[Any] = None, device: Optional[Any] = None) -> None:
        self.sharded, self.spec, self.input_check = sharded, spec, input_check
        self.weights, self.device = weights, device  # what fills each rank's tensors when it is built (loading.py)
        self.world_size = sharded.world_size
        self._ranks: dict[int, RankGenerator] = {}
        self._lock = threading.Lock()

    def rank(self, r: int) -> RankGenerator:
        """Rank r's generator (its graph built on first use; a process under torchrun builds only its own)."""
        module = self.sharded.rank(r)  # checks r
        with self._lock:
            if r not in self._ranks:
                if self.weights is not None:  # this rank's slices, and its cache on the rank's device
                    module = load_generation_rank(module, self.sharded, r, self.weights, CACHE_PREFIX, self.device)
                self._ranks[r] = RankGenerator(inference_module(module), self.spec, r, self.world_size,
                                               self.input_check)
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
