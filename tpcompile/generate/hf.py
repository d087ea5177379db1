"""Hugging Face causal language models with a KVCache: the model's own forward, given a cache object
whose layers write into the KVCache's buffers, and the masks built on the host.

The model computes exactly what it computes under `generate`: its embeddings, rotary positions
(`position_ids`, as `generate` derives them from the attention mask), attention and head; only
the storage of keys and values differs (static buffers instead of a DynamicCache, which
torch.export cannot take). The 4-D masks bypass the model's own mask construction, which reads
the cache's fill level (data-dependent control flow that export refuses).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch
from torch import nn

from tpcompile.errors import TPCompileError
from tpcompile.generate.cache import KVCache, LayerShape
from tpcompile.generate.locality import Locality, attention_kinds
from tpcompile.generate.masks import ADDITIVE_MASK, BOOL_MASK, attended_length, step_masks

_MASK_KINDS = {"sdpa": BOOL_MASK, "eager": ADDITIVE_MASK}


def is_hf_causal_lm(model: nn.Module) -> bool:
    """A transformers PreTrainedModel that generates (a *ForCausalLM or LMHead model)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # transformers is optional
        return False
    return isinstance(model, PreTrainedModel) and hasattr(model, "generate")


def _cache_classes() -> tuple[type, type]:
    """A Cache whose layers hand their keys and values to a callback (built on first use: transformers is optional)."""
    from transformers.cache_utils import Cache, CacheLayerMixin

    class CallbackLayer(CacheLayerMixin):
        is_compileable = True
        is_sliding = False

        def __init__(self, write: Callable[[torch.Tensor, torch.Tensor], tuple]) -> None:
            super().__init__()
            self.write, self.is_initialized = write, True

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            pass

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            return self.write(key_states, value_states)

        def get_mask_sizes(self, query_length: int, *args: Any) -> tuple[int, int]:
            raise TPCompileError("internal: the model built its own mask; the generation masks are 4-D")

        def get_seq_length(self) -> int:
            return 0

        def get_max_length(self) -> int:
            return -1

    class CallbackCache(Cache):
        def __init__(self, writers: list[Callable]) -> None:
            super().__init__(layers=[CallbackLayer(w) for w in writers])

    return CallbackCache, CallbackLayer


class HFAdapter:
    """Runs a Hugging Face *ForCausalLM with a KVCache (transformers 5: the `cache=` argument)."""

    def __init__(self, model: nn.Module) -> None:
        self.config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        impl = getattr(self.config, "_attn_implementation", None) or "eager"
        if impl not in _MASK_KINDS:
            raise TPCompileError(
                f"{type(model).__name__} uses attn_implementation={impl!r}; generation on sharded ranks supports "
                f"{', '.join(map(repr, _MASK_KINDS))}: load it with attn_implementation='sdpa'")
        self.mask_kind = _MASK_KINDS[impl]
        params = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self.keep_logits = "logits_to_keep" in params
        self.n_layers = int(self.config.num_hidden_layers)

    def locality(self, model: nn.Module, max_seq_len: int) -> dict[str, Locality]:
        """One mask per layer type when the kinds of layer differ (gemma3, qwen2 with sliding layers), else one mask
        for all (generate/locality.py)."""
        return attention_kinds(self.config, max_seq_len, type(model).__name__)

    def layers(self, model: nn.Module, kinds: dict[str, Locality]) -> list[LayerShape]:
        """Each layer's kv heads and head dim, read from one eager forward of two tokens."""
        found: dict[int, LayerShape] = {}

        def recorder(i: int) -> Callable:
            def write(k: torch.Tensor, v: torch.Tensor) -> tuple:
                found[i] = LayerShape(int(k.shape[1]), int(k.shape[-1]), k.dtype)
                if v.shape[1] != k.shape[1] or v.shape[-1] != k.shape[-1]:
                    raise TPCompileError(f"{type(model).__name__} layer {i} caches keys {tuple(k.shape)} and values "
                                         f"{tuple(v.shape)} of different sizes; the static cache needs them alike")
                return k, v
            return write

        device = next(model.parameters()).device
        ids = torch.zeros(1, 2, dtype=torch.long, device=device)
        pos = torch.arange(2, device=device)
        keep = torch.ones(1, 2, dtype=torch.bool, device=device)
        masks = step_masks(keep, pos, kinds, self.mask_kind, model.dtype)
        cache_cls, _ = _cache_classes()
        with torch.no_grad():
            self._call(model, cache_cls([recorder(i) for i in range(self.n_layers)]), ids, pos[None], masks)
        missing = [i for i in range(self.n_layers) if i not in found]
        if missing:
            raise TPCompileError(f"{type(model).__name__} layers {missing} wrote nothing to the cache (layers that "
                                 f"share another layer's cache are not supported); generate with the unsharded model")
        return [found[i] for i in range(self.n_layers)]

    def run(self, model: nn.Module, cache: KVCache, input_ids: torch.Tensor, position_ids: torch.Tensor,
            cache_position: torch.Tensor, masks: dict[str, torch.Tensor]) -> torch.Tensor:
        """The model's forward on the new tokens, its cache layers writing into `cache`."""
        cache_cls, _ = _cache_classes()
        length = attended_length(masks)
        writers = [_writer(cache, i, cache_position, length) for i in range(self.n_layers)]
        return self._call(model, cache_cls(writers), input_ids, position_ids, masks)

    def _call(self, model: nn.Module, cache: Any, input_ids: torch.Tensor, position_ids: torch.Tensor,
              masks: dict[str, torch.Tensor]) -> torch.Tensor:
        mask: Any = masks if len(masks) > 1 else next(iter(masks.values()))
        kwargs: dict[str, Any] = {self.cache_arg: cache, "use_cache": True}
        if self.keep_logits:
            kwargs["logits_to_keep"] = 1  # the head runs on the last token only
        out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, **kwargs)
        logits = out.logits if hasattr(out, "logits") else out[0]
        return logits[:, -1]

    def token_embedding(self, model: nn.Module) -> nn.Module:
        """The model's input embeddings."""
        return model.get_input_embeddings()

    def stop_tokens(self, model: nn.Module) -> tuple[list[int], Optional[int]]:
        """generation_config's eos_token_id (as a list) and pad_token_id, which generate uses by default."""
        gen = getattr(model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None)
        eos_list = [] if eos is None else [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
        pad = getattr(gen, "pad_token_id", None)
        return eos_list, None if pad is None else int(pad)


def _writer(cache: KVCache, layer: int, cache_position: torch.Tensor, length: int) -> Callable:
    def write(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return cache.write(layer, k, v, cache_position, length)
    return write
