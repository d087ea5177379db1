"""Small Hugging Face models built offline from their config classes (random weights)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

SIZES = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, max_position_embeddings=64)


@dataclass(frozen=True)
class Arch:
    """One architecture: how to build it, and which output holds its result."""

    name: str
    build: Callable[..., torch.nn.Module]
    output: str
    decoder: bool = True


def _tf() -> Any:
    import transformers
    transformers.logging.set_verbosity_error()
    return transformers


def gpt2(**kw: Any) -> torch.nn.Module:
    t = _tf()
    c = {**dict(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64), **kw}
    return t.GPT2LMHeadModel(t.GPT2Config(**c))


def llama(**kw: Any) -> torch.nn.Module:
    t = _tf()
    return t.LlamaForCausalLM(t.LlamaConfig(**{**SIZES, "intermediate_size": 128, "num_key_value_heads": 2, **kw}))


def mistral(**kw: Any) -> torch.nn.Module:
    t = _tf()
    return t.MistralForCausalLM(t.MistralConfig(**{**SIZES, "intermediate_size": 128, "num_key_value_heads": 2, **kw}))


def qwen2(**kw: Any) -> torch.nn.Module:
    t = _tf()
    return t.Qwen2ForCausalLM(t.Qwen2Config(**{**SIZES, "intermediate_size": 128, "num_key_value_heads": 2, **kw}))


def bert(**kw: Any) -> torch.nn.Module:
    t = _tf()
    return t.BertModel(t.BertConfig(**{**SIZES, "intermediate_size": 128, **kw}))


def opt(**kw: Any) -> torch.nn.Module:
    t = _tf()
    return t.OPTForCausalLM(t.OPTConfig(**{**SIZES, "ffn_dim": 128, "word_embed_proj_dim": 64, **kw}))


def gpt_neox(**kw: Any) -> torch.nn.Module:
    t = _tf()
    return t.GPTNeoXForCausalLM(t.GPTNeoXConfig(**{**SIZES, "intermediate_size": 128, "rotary_pct": 0.5, **kw}))


ARCHS = [Arch("gpt2", gpt2, "logits"), Arch("llama", llama, "logits"), Arch("mistral", mistral, "logits"),
         Arch("qwen2", qwen2, "logits"), Arch("bert", bert, "last_hidden_state", decoder=False),
         Arch("opt", opt, "logits"), Arch("gpt_neox", gpt_neox, "logits")]


def inputs(arch: Arch, batch: int, length: int) -> dict:
    """Keyword inputs for one forward: token ids, and use_cache=False for decoders."""
    ids = torch.randint(0, 128, (batch, length))
    if arch.decoder:
        return {"input_ids": ids, "use_cache": False}
    return {"input_ids": ids, "attention_mask": torch.ones(batch, length, dtype=torch.long)}


def build(arch: Arch, **kw: Any) -> torch.nn.Module:
    """The model with a fixed seed, in eval mode."""
    torch.manual_seed(0)
    return arch.build(**kw).eval()


def qwen3(**kw: Any) -> torch.nn.Module:
    """Qwen3: per-head RMSNorm on q and k (a replicated weight applied to split heads)."""
    t = _tf()
    return t.Qwen3ForCausalLM(t.Qwen3Config(**{**SIZES, "intermediate_size": 128, "num_key_value_heads": 2,
                                               "head_dim": 16, **kw}))
