"""Attention locality of a Hugging Face model, read from its config: which cached positions each kind of layer sees.

transformers drives its masks from these config fields (masking_utils.py and the models' own code):

    layer_types            per layer: "full_attention", "sliding_attention", "chunked_attention" (honoured);
                           recurrent, convolution, sparse, compressed or windowed kinds (refused, LAYER_TYPES)
    sliding_window         a sliding layer's window: query p sees j when p - j < window; without layer_types
                           it applies to every layer (mistral)
    attention_chunk_size   a chunked layer's chunk: p sees j in the same chunk, chunks counted from the row's
                           first real token (llama4); without layer_types (and no sliding_window) every layer
    attention_layers       GPT-Neo's "global" / "local" per layer with `window_size`: "local" layers band
                           their scores with a mask of their own, indexed by how many cached positions
                           attention reads, which the static cache's reads past the filled part shift (refused)
    use_sliding_window, max_window_layers, sliding_window_pattern, global_attn_every_n_layers, local_attention:
                           what the configs derive layer_types / sliding_window from (honoured through them)

Fields that change what a token sees in ways the 4-D masks cannot give are refused (REFUSED): a
TPCompileError naming the field and its value, at shard_generation time.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from tpcompile.errors import TPCompileError


@dataclass(frozen=True)
class Locality:
    """What a query at cache position p sees besides causality and padding: p - j < window, and j in p's chunk."""

    window: Optional[int] = None
    chunk: Optional[int] = None


FULL = Locality()

# layer_types value -> the reason it is refused (the honoured ones are in _KINDS)
LAYER_TYPES: dict[str, str] = {
    "linear_attention": "a recurrent state (Mamba, linear attention, gated delta rule) the key/value cache does not "
                        "hold",
    "conv": "a convolution state the key/value cache does not hold",
    "hybrid": "attention beside a recurrent state the key/value cache does not hold",
    "hybrid_sliding": "sliding attention beside a recurrent state the key/value cache does not hold",
    "moe": "layers without attention (nothing to cache)",
    "window_attention": "non-overlapping attention windows",
    "indexed_attention": "an indexer choosing which keys each token reads (sparse attention)",
    "compressed_sparse_attention": "compressed keys and values",
    "heavily_compressed_attention": "compressed keys and values",
    "minimax_m3_sparse": "lightning-index sparse attention",
    "reference_sliding_attention": "full attention over the prompt and a ring-buffered window over new tokens",
}
_KINDS = ("full_attention", "sliding_attention", "chunked_attention")


def _over(limit: Callable[[Any], bool], reason: str) -> Callable[[Any, int], Optional[str]]:
    """A refusal that applies when limit(value) holds."""
    return lambda value, max_seq_len: reason if limit(value) else None


# config field -> (value, max_seq_len) -> why it is refused, or None when the value changes nothing
REFUSED: dict[str, Callable[[Any, int], Optional[str]]] = {
    "use_bidirectional_attention": _over(bool, "tokens attend to later tokens, which generation cannot give"),
    "attention_type": _over(lambda v: v == "block_sparse", "block-sparse attention (random and global blocks)"),
    "keep_window_size": lambda v, n: (f"dynamic masking keeps the top {v} keys once more than {v} are read, which "
                                      f"depends on how many cached positions attention reads"
                                      if isinstance(v, int) and v < n - 1 else None),
    "local_attention_window_len": _over(lambda v: v is not None, "a byte-level local encoder's window"),
    "attention_window_size": _over(lambda v: v is not None, "a recurrent model's local attention window"),
}


def attention_kinds(config: Any, max_seq_len: int, owner: str) -> dict[str, Locality]:
    """The masks the model takes (name -> Locality; one name unless layer kinds differ); a TPCompileError names a
    field that cannot be honoured."""
    for field, why in REFUSED.items():
        value = getattr(config, field, None)
        reason = why(value, max_seq_len) if value is not None else None
        if reason:
            raise _refusal(owner, field, value, reason)
    window = _positive(config, "sliding_window", owner)
    chunk = _positive(config, "attention_chunk_size", owner)
    types = getattr(config, "layer_types", None)
    if types:
        for value in dict.fromkeys(types):
            if value not in _KINDS:
                reason = LAYER_TYPES.get(value, "a kind of layer without a mask rule here")
                raise _refusal(owner, "layer_types", value, reason)
        kinds = {t: Locality(window=window if t == "sliding_attention" else None,
                             chunk=chunk if t == "chunked_attention" else None) for t in sorted(set(types))}
        for t, loc in kinds.items():
            if t != "full_attention" and loc == FULL:
                field = "sliding_window" if t == "sliding_attention" else "attention_chunk_size"
                raise _refusal(owner, field, getattr(config, field, None), f"layer_types holds {t!r} without it")
        return kinds if len(kinds) > 1 else {"mask": next(iter(kinds.values()))}
    _refuse_own_bands(config, owner)
    if window is not None:  # every layer slides (mistral)
        return {"mask": Locality(window=window)}
    return {"mask": Locality(chunk=chunk)}  # every layer chunked, or plain causal (chunk None)


def _refuse_own_bands(config: Any, owner: str) -> None:
    """GPT-Neo's attention_layers: its "local" layers band their scores with `window_size` by a mask of their own."""
    layers = getattr(config, "attention_layers", None) or ()
    for value in dict.fromkeys(layers):
        if value != "global":
            reason = ("a local layer bands its scores with a mask of its own, indexed by how many cached positions "
                      f"attention reads (window_size={getattr(config, 'window_size', None)!r})"
                      if value == "local" else "a kind of layer without a mask rule here")
            raise _refusal(owner, "attention_layers", value, reason)


def _positive(config: Any, field: str, owner: str) -> Optional[int]:
    """An int > 0 or None (0 and -1 mean "off" in some configs: qwen2_moe, modernbert-decoder)."""
    value = getattr(config, field, None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _refusal(owner, field, value, "not a positive number of tokens")
    return value if value > 0 else None


def _refusal(owner: str, field: str, value: Any, reason: str) -> TPCompileError:
    return TPCompileError(
        f"{owner}: config.{field}={value!r} ({reason}) cannot be given by generation on sharded ranks, whose "
        f"masks see causal, sliding-window and chunked attention only; generate with the unsharded model "
        f"(model.generate), or shard its forward with tpcompile.shard")
