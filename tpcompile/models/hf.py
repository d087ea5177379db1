"""hf:<model_type>: a small, randomly initialised transformers model built offline from its config class."""
from __future__ import annotations

import difflib
from typing import Any

import torch
from torch import nn

from tpcompile.errors import TPCompileError

# Small sizes for Hugging Face configs, under the generic names every config understands.
HF_SIZES: dict[str, int] = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "vocab_size": 128,
    "max_position_embeddings": 64,
}

# Model-specific names for the same sizes, and sizes that must shrink with them (a rotary width no
# larger than the head dim 64 / 4); only the ones a config already has are passed.
HF_ALIASES: dict[str, int] = {
    "n_inner": 128,
    "ffn_dim": 128,
    "d_ff": 128,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "num_key_value_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_attention_heads": 4,
    "decoder_layers": 2,
    "num_decoder_layers": 2,
    "head_dim": 16,
    "d_kv": 16,
    "rotary_dim": 16,
}

HF_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
HF_BATCH, HF_SEQ = 2, 8


def _default_config(spec: str, model_type: str) -> Any:
    """transformers' default config of `model_type`, or a TPCompileError naming the nearest model types."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    try:
        return AutoConfig.for_model(model_type)
    except Exception as exc:
        # transformers' own message lists every model type there is: name the nearest few instead, and only
        # ones that look like the text (a cutoff of 0.6 offered 'evolla' for 'notamodel')
        close = difflib.get_close_matches(model_type.lower(), sorted(CONFIG_MAPPING_NAMES), n=4, cutoff=0.75)
        hint = (f"; did you mean {', '.join(close)}?" if close else
                "; the model types are the keys of transformers' CONFIG_MAPPING (e.g. hf:gpt2, hf:llama, hf:bert)")
        raise TPCompileError(f"cannot resolve model {spec!r}: transformers has no model type "
                             f"{model_type!r}{hint}") from exc


def _field(config: Any, key: str) -> str:
    """The config field a key sets: its attribute_map target (hidden_size -> n_embd for gpt2), else the key."""
    return dict(getattr(config, "attribute_map", {}) or {}).get(key, key)


def hf_config_kwargs(spec: str, model_type: str, default: Any, overrides: dict[str, Any]) -> dict[str, Any]:
    """The small sizes and the user's overrides as config arguments; a user's key replaces every default that
    sets the same field under another name (n_layer and num_hidden_layers are one field of gpt2)."""
    unknown = [k for k in overrides if not hasattr(default, k)]
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(default.to_dict()), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise TPCompileError(f"{spec}: the {model_type} config has no key {unknown[0]!r} (from --config){hint}")
    given: dict[str, str] = {}
    for key, value in overrides.items():
        field = _field(default, key)
        other = given.get(field)
        if other is not None and overrides[other] != value:
            raise TPCompileError(f"{spec}: --config {other}={overrides[other]} and {key}={value} set the same "
                                 f"{model_type} config field {field!r}; give one of them")
        given[field] = key
    small = dict(HF_SIZES)
    small.update({k: v for k, v in HF_ALIASES.items() if k in default.to_dict()})
    kwargs = {k: v for k, v in small.items() if _field(default, k) not in given}
    kwargs.update(overrides)
    vocab = kwargs.get("vocab_size", getattr(default, "vocab_size", None))
    for key in HF_TOKEN_IDS:
        token = getattr(default, key, None)
        if key not in overrides and isinstance(token, int) and isinstance(vocab, int) and token >= vocab:
            kwargs[key] = vocab - 1
    return kwargs


def hf_config(spec: str, model_type: str, overrides: dict[str, Any]) -> Any:
    """A small config for `model_type`: every size alias the config knows set small, then the overrides."""
    from transformers import AutoConfig

    default = _default_config(spec, model_type)
    kwargs = hf_config_kwargs(spec, model_type, default, overrides)
    try:
        return AutoConfig.for_model(model_type, **kwargs)
    except Exception as exc:
        raise TPCompileError(f"cannot resolve model {spec!r}: building a small {model_type} config failed: "
                             f"{type(exc).__name__}: {exc}; check the --config values") from exc


def _is_encoder(config: Any) -> bool:
    """Encoder-only families (bert, roberta, ...) are masked-LM models without a decoder."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    return config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not config.is_encoder_decoder


def load_hf(spec: str, model_type: str, overrides: dict[str, Any]) -> tuple[nn.Module, tuple, dict]:
    """Build a small, randomly initialised transformers model offline from its config class."""
    if not model_type:
        raise TPCompileError(f"cannot resolve model {spec!r}: hf: needs a model type, e.g. hf:gpt2")
    try:
        import transformers
    except ImportError as exc:
        raise TPCompileError(f"cannot resolve model {spec!r}: the transformers package is not installed "
                             "(pip install transformers)") from exc
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = hf_config(spec, model_type, overrides)
    encoder = _is_encoder(config)
    causal = not encoder and config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    auto = transformers.AutoModelForCausalLM if causal else transformers.AutoModel
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = auto.from_config(config)
    except Exception as exc:
        raise TPCompileError(f"cannot resolve model {spec!r}: building {auto.__name__} for {model_type} "
                             f"failed: {type(exc).__name__}: {exc}; check the --config values") from exc
    model.eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (HF_BATCH, HF_SEQ), generator=gen, dtype=torch.long)
    kwargs: dict[str, Any] = {"input_ids": ids}
    if not encoder:
        kwargs["use_cache"] = False
    if config.is_encoder_decoder and not causal:
        kwargs["decoder_input_ids"] = ids.clone()
    return model, (), kwargs
