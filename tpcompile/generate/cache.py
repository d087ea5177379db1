"""The model and a static key/value cache as one module, the thing the compiler captures and shards.

`KVCache` holds one key and one value buffer per attention layer, (max_batch_size, kv heads,
max_seq_len, head dim), written in place with `index_copy_` at the cache positions of the new
tokens. The compiler sees a buffer written with a value split by heads and splits the buffer
the same way (sharding_rules/state.py), so each rank allocates and holds only its heads.

`CachedLM.forward(input_ids, position_ids, cache_position, masks)` runs the new tokens (a
whole prompt, or one token) against everything cached so far and returns the logits of each
row's last token, (B, vocab): one graph serves prefill and decode. Attention reads the first L
cached positions, L being the masks' last dim (masks.attended_length): the generate loop passes
the filled part of the cache rounded up to a bucket, not all max_seq_len positions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch
from torch import nn


@dataclass(frozen=True)
class LayerShape:
    """What one attention layer caches per token: kv heads x head dim, in this dtype."""

    heads: int
    head_dim: int
    dtype: torch.dtype


class KVCache(nn.Module):
    """Key and value buffers per layer, written in place at the new tokens' cache positions."""

    def __init__(self, shapes: list[LayerShape], max_batch_size: int, max_seq_len: int,
                 device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.shapes = list(shapes)
        for i, s in enumerate(self.shapes):
            for kind in ("k", "v"):
                buf = torch.zeros(max_batch_size, s.heads, max_seq_len, s.head_dim, dtype=s.dtype, device=device)
                self.register_buffer(f"{kind}{i}", buf, persistent=False)

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor, cache_position: torch.Tensor,
              length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store (B, heads, T, head_dim) keys and values at `cache_position` (T,); the batch's first `length`
        cached positions back, (B, heads, length, head_dim), for attention to read."""
        batch = keys.shape[0]  # may be less than the batch the cache was allocated for
        k = getattr(self, f"k{layer}")[:batch]
        v = getattr(self, f"v{layer}")[:batch]
        k.index_copy_(2, cache_position, keys.to(k.dtype))
        v.index_copy_(2, cache_position, values.to(v.dtype))
        return k[:, :, :length], v[:, :, :length]

    def nbytes(self) -> int:
        """Bytes held by the buffers."""
        return sum(b.numel() * b.element_size() for b in self.buffers())


class Adapter(Protocol):
    """How one family of models runs with a KVCache (Hugging Face models, the bundled GPT)."""

    mask_kind: str  # masks.BOOL_MASK or masks.ADDITIVE_MASK, as the model's attention takes it

    def layers(self, model: nn.Module, kinds: dict[str, Any]) -> list[LayerShape]:
        """What each attention layer caches (found with masks of these kinds)."""

    def locality(self, model: nn.Module, max_seq_len: int) -> dict[str, Any]:
        """The kinds of attention mask the layers take: name -> locality.Locality."""

    def run(self, model: nn.Module, cache: KVCache, input_ids: torch.Tensor, position_ids: torch.Tensor,
            cache_position: torch.Tensor, masks: dict[str, torch.Tensor]) -> torch.Tensor:
        """The logits (B, vocab) of each row's last token, the cache written for every token."""

    def stop_tokens(self, model: nn.Module) -> tuple[list[int], Optional[int]]:
        """The model's own end-of-sequence ids and padding id (Hugging Face generate's defaults)."""

    def token_embedding(self, model: nn.Module) -> nn.Module:
        """The embedding of token ids (the other embeddings read positions)."""


class CachedLM(nn.Module):
    """`model` and its KVCache; forward runs new tokens against the cache and returns next-token logits."""

    def __init__(self, model: nn.Module, adapter: Adapter, shapes: list[LayerShape], max_batch_size: int,
                 max_seq_len: int) -> None:
        super().__init__()
        self.model = model
        # beside the weights: a model on a GPU keeps its cache there
        device = next((t.device for t in model.parameters()), None)
        self.kv = KVCache(shapes, max_batch_size, max_seq_len, device)
        self._adapter = adapter

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache_position: torch.Tensor,
                masks: dict[str, torch.Tensor]) -> torch.Tensor:
        """input_ids, position_ids (B, T); cache_position (T,); masks name -> (B, 1, T, max_seq_len) -> (B, vocab)."""
        return self._adapter.run(self.model, self.kv, input_ids, position_ids, cache_position, masks)
