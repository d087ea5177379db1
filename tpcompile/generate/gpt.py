"""The bundled GPT (tpcompile.models) with a KVCache: its own modules, run token by token.

The bundled GPT's forward recomputes the whole sequence; this adapter calls the same modules
(embeddings, norms, projections, MLP, head) in the same order and keeps keys and values in the
cache, so the sharded ranks split the very weights the model holds.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from tpcompile.generate.cache import KVCache, LayerShape
from tpcompile.generate.locality import FULL, Locality
from tpcompile.generate.masks import BOOL_MASK


def is_bundled_gpt(model: nn.Module) -> bool:
    """The GPT of tpcompile.models."""
    from tpcompile.models.gpt import GPT
    return isinstance(model, GPT)


class GPTAdapter:
    """Runs tpcompile.models.GPT with a KVCache: one mask for every layer, SDPA with it."""

    mask_kind = BOOL_MASK

    def layers(self, model: nn.Module, kinds: dict[str, Locality]) -> list[LayerShape]:
        """n_head heads of n_embd / n_head per layer."""
        c = model.config
        dtype = model.transformer.wte.weight.dtype
        return [LayerShape(c.n_head, c.n_embd // c.n_head, dtype) for _ in range(c.n_layer)]

    def locality(self, model: nn.Module, max_seq_len: int) -> dict[str, Locality]:
        """Full causal attention in every layer."""
        return {"mask": FULL}

    def run(self, model: nn.Module, cache: KVCache, input_ids: torch.Tensor, position_ids: torch.Tensor,
            cache_position: torch.Tensor, masks: dict[str, torch.Tensor]) -> torch.Tensor:
        """Embed, run each block against the cache, and return the last token's logits (B, vocab)."""
        t = model.transformer
        x = t.drop(t.wte(input_ids) + t.wpe(position_ids))
        mask = masks["mask"]  # (B, 1, T, L): attention reads the first L cached positions
        for i, block in enumerate(t.h):
            x = x + _attend(block.attn, block.ln_1(x), cache, i, cache_position, mask)
            x = x + block.mlp(block.ln_2(x))
        return model.lm_head(t.ln_f(x[:, -1:]))[:, -1]

    def token_embedding(self, model: nn.Module) -> nn.Module:
        """transformer.wte (wpe reads positions)."""
        return model.transformer.wte

    def stop_tokens(self, model: nn.Module) -> tuple[list[int], Optional[int]]:
        """The bundled GPT has no end-of-sequence token."""
        return [], None


def _attend(attn: nn.Module, x: torch.Tensor, cache: KVCache, layer: int, cache_position: torch.Tensor,
            mask: torch.Tensor) -> torch.Tensor:
    """CausalSelfAttention.forward with the keys and values of earlier tokens read from the cache."""
    B, T, C = x.shape
    if attn.fused_qkv:
        q, k, v = attn.c_attn(x).split(attn.n_embd, dim=2)
    else:
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    # (B, nh, T, hd)
    q, k, v = (t.view(B, T, attn.n_head, C // attn.n_head).transpose(1, 2) for t in (q, k, v))
    keys, values = cache.write(layer, k, v, cache_position, mask.shape[-1])  # (B, nh, L, hd)
    y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    y = y.transpose(1, 2).contiguous().view(B, T, C)
    return attn.resid_dropout(attn.c_proj(y))
