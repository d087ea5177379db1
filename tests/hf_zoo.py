"""Every causal-LM architecture the installed transformers ships, built small and offline from its config class.

The architectures are the keys of transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES (model_type -> class). Each
config gets the small sizes below under every name the config class has for them, in its sub-configs
(text_config, vision_config, ...) too; per-layer lists are cut to the layer count keeping one layer of each
kind; EXTRAS holds the few settings a model type needs beyond that. Weights are random with a fixed seed, eval
mode, nothing downloaded. `unsharded_reason` says why a model cannot run from its small config, if it cannot.
"""
from __future__ import annotations

import dataclasses
import inspect
import os
import re
from typing import Any, Optional

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs and models only: never reach the network

LAYERS, WIDTH, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, POSITIONS = 2, 64, 4, 2, 16, 128, 128, 64
EXAMPLE = (2, 8)  # (batch, length) the graph is captured with
RUN = (3, 13)  # (batch, length) it then runs on
MAX_PARAMS = 20_000_000  # a small config far above this kept a large size under a name SIZES lacks

# config field -> small value; a field is set only where the config class has it
SIZES: dict[str, Any] = {
    **dict.fromkeys(("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "encoder_layers",
                     "num_decoder_layers", "num_encoder_layers", "num_blocks"), LAYERS),
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "dim", "emb_dim", "embed_dim", "embedding_size",
                     "word_embed_proj_dim", "input_embedding_size", "output_embedding_size",
                     "lru_width", "backbone_hidden_size", "hidden_size_global", "nemo_conv_channels",
                     "ext_pw_out_channel", "depthwise_separable_out_channel"), WIDTH),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads",
                     "encoder_attention_heads", "swa_num_attention_heads", "linear_num_value_heads",
                     "linear_num_heads", "mamba_n_heads", "mamba_num_heads", "n_mamba_heads", "index_n_heads"),
                    HEADS),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "num_query_groups", "linear_num_key_heads",
                     "swa_num_key_value_heads"), KV_HEADS),
    **dict.fromkeys(("head_dim", "d_head", "dim_head", "kv_channels", "attention_head_size", "attention_head_dim",
                     "swa_head_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_head_dim",
                     "index_head_dim", "v_head_dim", "qk_nope_head_dim"), HEAD_DIM),
    # Mamba-2 heads tile the inner width, expand (2) times the model's
    **dict.fromkeys(("mamba_d_head", "mamba_head_dim", "mamba_headdim"), 2 * WIDTH // HEADS),
    **dict.fromkeys(("mamba_d_ssm",), 2 * WIDTH),
    **dict.fromkeys(("n_group", "num_expert_group", "topk_group", "n_groups", "mamba_n_groups", "mamba_ngroups"), 1),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "d_ff", "dim_ff", "dff", "d_inner",
                     "encoder_ffn_dim", "decoder_ffn_dim", "ffn_hidden_size", "feed_forward_size",
                     "intermediate_size_mlp", "dense_intermediate_size", "expert_ffn_hidden_size"), FFN),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "shared_intermediate_size",
                     "shared_experts_intermediate_size", "moe_shared_expert_intermediate_size"), 32),
    **dict.fromkeys(("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "moe_k"), 2),
    **dict.fromkeys(("q_lora_rank", "kv_lora_rank", "o_lora_rank"), 16),
    **dict.fromkeys(("qk_rope_head_dim", "rotary_dim"), 8),
    **dict.fromkeys(("vocab_size", "decoder_vocab_size", "vocab_size_per_layer_input",
                     "encoder_hash_byte_group_vocab", "unpadded_vocab_size", "pronunciation_vocab_size",
                     "shape_vocab_size"), VOCAB),
    **dict.fromkeys(("pronunciation_embed_dim", "shape_embed_dim", "rel_extent"), 16),
    **dict.fromkeys(("zero_expert_num",), 2),
    **dict.fromkeys(("hidden_size_per_layer_input",), 8),
    **dict.fromkeys(("n_shared_experts",), 1),
    # hybrids place attention (and experts) every `period` layers from `offset`: one of each in two layers
    **dict.fromkeys(("attn_layer_period", "expert_layer_period"), 2),
    **dict.fromkeys(("attn_layer_offset", "expert_layer_offset"), 1),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_target_positions",
                     "max_source_positions", "max_seq_len", "context_length", "model_max_length"), POSITIONS),
    **dict.fromkeys(("sliding_window", "sliding_window_size", "attention_window_size", "local_attention_window_len",
                     "attention_chunk_size", "window_size"), 8),
    **dict.fromkeys(("state_size", "mamba_d_state", "ssm_state_size", "time_step_rank", "mamba_dt_rank"), 16),
    **dict.fromkeys(("index_topk",), 4),
}
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "sep_token_id",
             "cls_token_id", "mask_token_id", "unk_token_id")

# model_type -> config settings beyond SIZES, each with the reason it is needed
EXTRAS: dict[str, dict[str, Any]] = {
    "mamba2": {"head_dim": 2 * WIDTH // HEADS},  # Mamba-2's heads (num_heads, head_dim) tile 2 x the width
    "zaya": {"num_experts_per_tok": 1},  # the only routing ZAYA supports
    "xmod": {"default_language": "en_XX"},  # X-MOD's adapters need a language
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},  # its default has none
    "zamba": {"layers_block_type": ["hybrid", "hybrid"]},  # its shared attention needs two layers to share
    "reformer": {"axial_pos_embds_dim": [32, 32], "axial_pos_shape": [8, 8]},  # the factors sum to the width
    "dots3_note_text": {"head_dim": 24},  # its sliding layers' head_dim is qk_nope + qk_rope (16 + 8)
    "gemma3n_text": {"num_kv_shared_layers": 0},  # two layers leave none to share keys and values from
    # defaults that do not build at all in this transformers: the settings they lack
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}},
    "dbrx": {"attn_config": {"kv_n_heads": KV_HEADS, "rope_theta": 1e4, "clip_qkv": 8.0}},
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0,
                                         "enable_moe_block": False}},
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": HEAD_DIM, "indexer_budget": 8,
                       "indexer_compress_ratio": 2},
}


def _tf() -> Any:
    """transformers, with its log quiet."""
    import transformers
    transformers.logging.set_verbosity_error()
    return transformers


def zoo_types() -> list[str]:
    """Every causal-LM model type the installed transformers maps to a class, in its order."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _fields(cls: type) -> tuple[dict[str, Any], Any]:
    """Every field a config class takes with its default value, and the default instance (None if it fails)."""
    found: dict[str, Any] = {}
    if dataclasses.is_dataclass(cls):
        for f in dataclasses.fields(cls):
            found[f.name] = f.default if f.default is not dataclasses.MISSING else None
    for name, p in inspect.signature(cls.__init__).parameters.items():
        if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and name != "self":
            found.setdefault(name, None if p.default is p.empty else p.default)
    try:  # the instance's values hold what __init__ derives (layer_types from the layer count)
        default = cls()
        found.update(default.to_dict())
    except Exception:  # noqa: BLE001  a default that does not validate: the declared fields still tell
        default = None
    return found, default


def _layer_list(values: list, layers: int) -> list:
    """A per-layer list cut to `layers` entries, keeping the first layer of each kind where they fit."""
    kinds = list(dict.fromkeys(v for v in values if isinstance(v, (str, int, bool))))
    if len(kinds) != len(set(map(repr, values))):  # unhashable or mixed entries: the first layers
        return values[:layers]
    picked = kinds[:layers]
    return picked + [values[0]] * (layers - len(picked))


def small_kwargs(cls: type, model_type: str = "") -> dict[str, Any]:
    """The config arguments that make `cls` small: SIZES where it has them, sub-configs alike, lists cut."""
    fields, default = _fields(cls)
    kw = {k: v for k, v in SIZES.items() if k in fields}
    if "num_key_value_heads" in kw and fields.get("num_key_value_heads") in (None, fields.get("num_attention_heads")):
        kw["num_key_value_heads"] = HEADS  # a model without grouped heads by default keeps them whole
    layers_default = next((fields[k] for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
                           if isinstance(fields.get(k), int)), None)
    for k, v in fields.items():
        if isinstance(v, list) and layers_default and len(v) == layers_default and layers_default != LAYERS:
            kw[k] = [SIZES[k]] * LAYERS if k in SIZES else _layer_list(v, LAYERS)  # per-layer widths: small
    if isinstance(fields.get("per_layer_config"), dict):  # heterogeneous layers: only the kept ones, small
        kw["per_layer_config"] = {i: {k: SIZES.get(k, v) for k, v in c.items()}
                                  for i, c in fields["per_layer_config"].items() if int(i) < LAYERS}
    for k in TOKEN_IDS:
        v = fields.get(k)
        if isinstance(v, int) and v >= VOCAB:
            kw[k] = VOCAB - 1 - TOKEN_IDS.index(k)
        elif isinstance(v, list) and any(isinstance(t, int) and t >= VOCAB for t in v):
            kw[k] = [t if t < VOCAB else VOCAB - 1 - i for i, t in enumerate(v)]
    if "qk_rope_head_dim" in fields and "head_dim" in fields:  # latent attention: head_dim as the default ties it
        rope, nope = fields.get("qk_rope_head_dim"), fields.get("qk_nope_head_dim")
        if fields.get("head_dim") == rope:
            kw["head_dim"] = SIZES["qk_rope_head_dim"]
        elif isinstance(rope, int) and isinstance(nope, int) and fields.get("head_dim") == rope + nope:
            kw["head_dim"] = SIZES["qk_rope_head_dim"] + SIZES["qk_nope_head_dim"]
    if "is_decoder" in fields:  # encoder families (bert, roberta, ...) run as causal LMs only as decoders
        kw["is_decoder"] = True
    specs = getattr(cls, "sub_configs_defaults", None) or {}
    for name, declared in (getattr(cls, "sub_configs", None) or {}).items():
        sub = getattr(default, name, None) if default is not None else None
        auto = getattr(declared, "__name__", "") == "AutoConfig"
        if sub is not None and not isinstance(sub, dict):  # the class the default holds (AutoConfig slots)
            sub_cls = type(sub)
        elif default is None and not auto:
            sub_cls = declared
        elif default is None and getattr(specs.get(name), "model_type", None):  # what the slot defaults to
            sub_cls = _tf().CONFIG_MAPPING[specs[name].model_type]
        else:
            continue
        small = small_kwargs(sub_cls, getattr(sub_cls, "model_type", ""))
        kw[name] = {**({"model_type": sub_cls.model_type} if auto else {}), **small}
    extras = {**EXTRAS.get(getattr(cls, "model_type", ""), {}), **EXTRAS.get(model_type, {})}
    for k, v in extras.items():  # a sub-config's extras merge into its small settings
        kw[k] = {**kw[k], **v} if isinstance(v, dict) and isinstance(kw.get(k), dict) else v
    return kw


def config_class(model_type: str) -> type:
    """The config class the causal LM of `model_type` takes: the mapped one, or the part of a composite
    config (MusicgenConfig's decoder) that its causal LM class is declared for."""
    t = _tf()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    mapped = t.CONFIG_MAPPING[model_type]
    wanted = getattr(getattr(t, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type], None), "config_class", None)
    parts = (getattr(mapped, "sub_configs", None) or {}).values()
    return wanted if wanted is not mapped and any(p is wanted for p in parts) else mapped


def zoo_config(model_type: str) -> Any:
    """The small config of `model_type`."""
    cls = config_class(model_type)
    return cls(**small_kwargs(cls, model_type))


class TooLarge(ValueError):
    """A small config that still makes a model too large to build here."""


def model_class(model_type: str) -> type:
    """The causal-LM class transformers maps `model_type` to."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(_tf(), MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def zoo_build(model_type: str) -> torch.nn.Module:
    """The small causal LM of `model_type`: random weights from seed 0, fp32, eval mode."""
    config = zoo_config(model_type)
    with torch.device("meta"):  # count first: a size field SIZES misses could ask for gigabytes
        n = sum(p.numel() for p in model_class(model_type)._from_config(config).parameters())
    if n > MAX_PARAMS:
        raise TooLarge(f"{n / 1e6:.0f}M parameters after shrinking (at most {MAX_PARAMS / 1e6:.0f}M)")
    torch.manual_seed(0)
    return model_class(model_type)._from_config(config).float().eval()


def zoo_inputs(model: torch.nn.Module, batch: int, length: int, *, seed: int = 1) -> dict[str, Any]:
    """Keyword inputs of one forward: token ids from `seed`, and use_cache=False where the model takes it."""
    gen = torch.Generator().manual_seed(seed)
    rows = batch * getattr(model.config, "num_codebooks", 1)  # audio decoders read one row per codebook
    kw: dict[str, Any] = {"input_ids": torch.randint(0, VOCAB, (rows, length), generator=gen)}
    params = inspect.signature(model.forward).parameters
    if "use_cache" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kw["use_cache"] = False
    return kw


def one_line(exc: BaseException) -> str:
    """An exception in one line: a TPCompileError's first sentence, else its type and first line."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    text = " ".join(lines[:2]) if lines and lines[0].endswith(":") else (lines[0] if lines else "")
    if type(exc).__name__ == "TPCompileError":  # its first sentence; after a ';' comes the way out
        return re.split(r"(?<=\.) |; ", text, maxsplit=1)[0].strip()[:300]
    return f"{type(exc).__name__}: {text}"[:300]


def unsharded_reason(model_type: str) -> Optional[str]:
    """Why the small `model_type` model cannot run unsharded (one line), or None when it builds and runs."""
    try:
        model = zoo_build(model_type)
    except Exception as exc:  # noqa: BLE001  every failure is a reason, not a crash
        return f"build: {one_line(exc)}"
    for batch, length in (EXAMPLE, RUN):
        try:
            with torch.no_grad():
                model(**zoo_inputs(model, batch, length))
        except Exception as exc:  # noqa: BLE001
            return f"forward at ({batch}, {length}): {one_line(exc)}"
    return None
