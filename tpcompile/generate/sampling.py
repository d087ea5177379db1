"""The next token from the last position's logits: greedy, or sampled as Hugging Face generate samples.

Every rank holds the same logits (the head's vocabulary shards are gathered once per step), so
each rank picks the same token by itself: greedy is an argmax, and sampling draws from a
generator seeded alike on every rank. A Hugging Face model's logits go through the processors its
generate would apply (generate/processors.py: penalties, suppressions, and when sampling its
warpers), then a softmax and one draw per row with torch.multinomial. The bundled GPT, which has
no generation config, applies temperature, then top-k, then top-p (HF's order of warpers).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from tpcompile.errors import TPCompileError


@dataclass(frozen=True)
class Sampling:
    """How to choose: greedy (do_sample=False) or sampled with these warpers."""

    do_sample: bool = False
    temperature: Optional[float] = 1.0  # None (as top_k, top_p): the model's generation_config, else no change
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    processors: Any = None  # a transformers LogitsProcessorList (warpers included): replaces the three above

    def check(self) -> "Sampling":
        """Values generate accepts, else a TPCompileError naming the argument."""
        if self.do_sample and self.temperature is not None and not (
                isinstance(self.temperature, (int, float)) and not isinstance(self.temperature, bool)
                and self.temperature > 0):
            raise TPCompileError(f"temperature must be a number > 0, got {self.temperature!r}; use do_sample=False "
                                 f"for greedy decoding")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                                       or self.top_k < 1):
            raise TPCompileError(f"top_k must be an int >= 1 or None, got {self.top_k!r}")
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise TPCompileError(f"top_p must be a number in (0, 1] or None, got {self.top_p!r}")
        return self


def next_tokens(logits: torch.Tensor, how: Sampling, generator: Optional[torch.Generator],
                sequence: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(B, vocab) logits -> (B,) token ids; `sequence` (B, tokens so far) is what the processors read."""
    scores = logits.float()  # generate picks in float32 whatever the model's dtype
    if how.processors is not None:
        if len(how.processors):
            scores = how.processors(sequence, scores)
        if not how.do_sample:
            return scores.argmax(dim=-1)
        return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1, generator=generator).squeeze(1)
    if not how.do_sample:
        return scores.argmax(dim=-1)
    if how.temperature is not None:
        scores = scores / how.temperature
    if how.top_k is not None and how.top_k < scores.shape[-1]:
        kth = torch.topk(scores, how.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if how.top_p is not None and how.top_p < 1.0:
        scores = _top_p(scores, how.top_p)
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)


def _top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probabilities add up to top_p (at least one)."""
    ordered, order = torch.sort(scores, descending=False)
    cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1 - top_p)
    drop[..., -1:] = False  # the most likely token always stays
    return scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
