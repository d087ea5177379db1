"""Small Hugging Face models built offline from their config classes (random weights)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

SIZES = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, max_position_embeddings=64)


@dataclass(frozen=True)
class Arch:
    """One architecture: how to build it, and which output holds its result."""

    name: str
    build: Callable[..., torch.nn.Module]
    output: str
    decoder: bool = True
    feeds: str = "tokens"  # "tokens", "seq2seq" (+ decoder_input_ids) or "audio" (input_features + decoder_input_ids)


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
    """Keyword inputs for one forward: token ids, and use_cache=False for decoders.

    Encoder-decoder models get decoder_input_ids of the same length; Whisper gets mel features of the one
    length its encoder accepts (2 * max_source_positions) and `length` decoder tokens.
    """
    ids = torch.randint(0, 128, (batch, length))
    if arch.feeds == "seq2seq":
        return {"input_ids": ids, "decoder_input_ids": torch.randint(0, 128, (batch, length)), "use_cache": False}
    if arch.feeds == "audio":
        return {"input_features": torch.randn(batch, 16, 32), "decoder_input_ids": ids, "use_cache": False}
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


LLAMA_LIKE = {**SIZES, "intermediate_size": 128}
MOE = dict(num_experts=4, num_experts_per_tok=2)


def phi(**kw: Any) -> torch.nn.Module:
    """Phi: parallel attention and MLP from one LayerNorm, partial rotary, biased head."""
    t = _tf()
    return t.PhiForCausalLM(t.PhiConfig(**{**LLAMA_LIKE, "num_key_value_heads": 4, **kw}))


def phi3(**kw: Any) -> torch.nn.Module:
    """Phi-3: fused qkv_proj and fused gate_up_proj."""
    t = _tf()
    return t.Phi3ForCausalLM(t.Phi3Config(**{**LLAMA_LIKE, "num_key_value_heads": 2, "pad_token_id": 0, **kw}))


def falcon(**kw: Any) -> torch.nn.Module:
    """Falcon-7B style: multi-query (one kv head) fused query_key_value, parallel attention and MLP."""
    t = _tf()
    c = {**SIZES, "ffn_hidden_size": 128, "multi_query": True, "parallel_attn": True,
         "bos_token_id": 1, "eos_token_id": 2, **kw}
    return t.FalconForCausalLM(t.FalconConfig(**c))


def gpt_bigcode(**kw: Any) -> torch.nn.Module:
    """GPTBigCode (SantaCoder): multi-query attention, c_attn = q | k | v with one kv head (whole on every
    rank); 8 query heads of 8 (SantaCoder has 16, StarCoder 48: the one kv head is a small part of attention),
    the MLP 4x as wide as the model, as in GPT-2."""
    t = _tf()
    c = {**dict(n_layer=2, n_embd=64, n_head=8, vocab_size=128, n_positions=64, multi_query=True,
                bos_token_id=1, eos_token_id=2), **kw}
    return t.GPTBigCodeForCausalLM(t.GPTBigCodeConfig(**c))


def stablelm(**kw: Any) -> torch.nn.Module:
    """StableLM: LayerNorm, rotary on a quarter of each head."""
    t = _tf()
    return t.StableLmForCausalLM(t.StableLmConfig(**{**LLAMA_LIKE, "num_key_value_heads": 4, **kw}))


def persimmon(**kw: Any) -> torch.nn.Module:
    """Persimmon: fused query_key_value viewed per head as (q, k, v), per-head LayerNorm on q and k."""
    t = _tf()
    return t.PersimmonForCausalLM(t.PersimmonConfig(**{**LLAMA_LIKE, **kw}))


def albert(**kw: Any) -> torch.nn.Module:
    """ALBERT: factorised embedding (16 -> 64, about ALBERT-base's 128 -> 768) and one layer's weights shared by
    both layers; an MLP 4x as wide as the model, as in ALBERT."""
    t = _tf()
    return t.AlbertModel(t.AlbertConfig(**{**SIZES, "intermediate_size": 256, "embedding_size": 16, **kw}))


def xglm(**kw: Any) -> torch.nn.Module:
    """XGLM: sinusoidal positions, scaled embedding, pre-LayerNorm decoder."""
    t = _tf()
    c = dict(num_layers=2, d_model=64, attention_heads=4, ffn_dim=128, vocab_size=128, max_position_embeddings=64)
    return t.XGLMForCausalLM(t.XGLMConfig(**{**c, **kw}))


def biogpt(**kw: Any) -> torch.nn.Module:
    """BioGPT: learned positions with an offset, scaled embedding."""
    t = _tf()
    return t.BioGptForCausalLM(t.BioGptConfig(**{**LLAMA_LIKE, **kw}))


def bart(**kw: Any) -> torch.nn.Module:
    """BART: encoder-decoder with cross-attention; logits of the decoder (tied head plus final_logits_bias)."""
    t = _tf()
    c = dict(vocab_size=128, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
             decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64)
    return t.BartForConditionalGeneration(t.BartConfig(**{**c, **kw}))


def whisper(**kw: Any) -> torch.nn.Module:
    """Whisper: two convolutions over 16 mel bins, encoder-decoder, MLPs 4x as wide as the model (as in
    Whisper); logits of the decoder."""
    t = _tf()
    c = dict(vocab_size=128, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
             decoder_attention_heads=4, encoder_ffn_dim=256, decoder_ffn_dim=256, num_mel_bins=16,
             max_source_positions=16, max_target_positions=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             decoder_start_token_id=1, suppress_tokens=None, begin_suppress_tokens=None)
    return t.WhisperForConditionalGeneration(t.WhisperConfig(**{**c, **kw}))


def gemma3(**kw: Any) -> torch.nn.Module:
    """Gemma 3 text: sliding and full attention layers, per-head RMSNorm on q and k, scaled tied embedding."""
    t = _tf()
    c = {**LLAMA_LIKE, "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 8,
         "layer_types": ["sliding_attention", "full_attention"], **kw}
    return t.Gemma3ForCausalLM(t.Gemma3TextConfig(**c))


def qwen2_moe(**kw: Any) -> torch.nn.Module:
    """Qwen2-MoE: 4 experts, top 2, and a shared expert gated by a sigmoid."""
    t = _tf()
    c = {**LLAMA_LIKE, **MOE, "num_key_value_heads": 4, "moe_intermediate_size": 32,
         "shared_expert_intermediate_size": 64, **kw}
    return t.Qwen2MoeForCausalLM(t.Qwen2MoeConfig(**c))


def olmoe(**kw: Any) -> torch.nn.Module:
    """OLMoE: 4 experts, top 2; RMSNorm over all of q and of k (not per head)."""
    t = _tf()
    return t.OlmoeForCausalLM(t.OlmoeConfig(**{**SIZES, **MOE, "intermediate_size": 32, "num_key_value_heads": 4,
                                                **kw}))


def phimoe(**kw: Any) -> torch.nn.Module:
    """PhiMoE: 4 experts, top 2 by sparsemixer routing, LayerNorm, biased attention projections."""
    t = _tf()
    c = {**SIZES, "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2,
         "num_key_value_heads": 2, **kw}
    return t.PhimoeForCausalLM(t.PhimoeConfig(**c))


def deepseek_v3(**kw: Any) -> torch.nn.Module:
    """DeepSeek-V3: multi-head latent attention (q and kv through 16-wide latents, a quarter of the width as in
    the real model's 1536 of 7168), a dense first layer, then 4 routed experts (top 2, one group) and a shared
    expert."""
    t = _tf()
    c = {**LLAMA_LIKE, "num_key_value_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
         "qk_nope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1,
         "topk_group": 1, "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1, **kw}
    return t.DeepseekV3ForCausalLM(t.DeepseekV3Config(**c))


def falcon_mamba(**kw: Any) -> torch.nn.Module:
    """Falcon-Mamba: selective state-space blocks (no attention), inner width 128."""
    t = _tf()
    c = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, state_size=16, time_step_rank=8,
             conv_kernel=4, vocab_size=128, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    return t.FalconMambaForCausalLM(t.FalconMambaConfig(**{**c, **kw}))


NEW_ARCHS = [Arch("phi", phi, "logits"), Arch("phi3", phi3, "logits"), Arch("falcon", falcon, "logits"),
             Arch("gpt_bigcode", gpt_bigcode, "logits"), Arch("stablelm", stablelm, "logits"),
             Arch("persimmon", persimmon, "logits"), Arch("albert", albert, "last_hidden_state", decoder=False),
             Arch("xglm", xglm, "logits"), Arch("biogpt", biogpt, "logits"),
             Arch("bart", bart, "logits", feeds="seq2seq"), Arch("whisper", whisper, "logits", feeds="audio"),
             Arch("gemma3", gemma3, "logits"), Arch("qwen2_moe", qwen2_moe, "logits"), Arch("olmoe", olmoe, "logits"),
             Arch("phimoe", phimoe, "logits"), Arch("deepseek_v3", deepseek_v3, "logits"),
             Arch("falcon_mamba", falcon_mamba, "logits")]
ALL_ARCHS = ARCHS + NEW_ARCHS


def param_bytes(model: torch.nn.Module, sm: Any) -> tuple[int, int]:
    """(bytes of one rank's parameter slices, bytes of all parameters), from the plan (tied weights once)."""
    sizes = {n: p.element_size() for n, p in model.named_parameters(remove_duplicate=False)}
    local = sum(math.prod(pp.local_shape) * sizes[n] for n, pp in sm.plan.parameters.items())
    return local, sum(math.prod(pp.global_shape) * sizes[n] for n, pp in sm.plan.parameters.items())


def balanced_bytes(model: torch.nn.Module, sm: Any) -> int:
    """The largest rank's parameter bytes if every parameter the plan splits were split balanced by whole units.

    A unit is one head (head_dim features) for a split segment of an attention module's parameter whose size
    is a multiple of head_dim; a head's share of the segment where that is a larger multiple of head_dim (the
    module's `num_heads`, else the config's): a fused q|k|v the plan splits as one, interleaved per head,
    GPT-NeoX's (one head's q, k and v, 3 x head_dim, as a rank computing a head needs all three), MLA's q and kv
    (nope and rope parts, keys and values), a module whose heads are wider than the config's head_dim. In a block
    not named attention that holds heads (a leaf module's `num_heads` in it: xLSTM's mLSTM layer), a head's
    share of the segment. In a Mamba-2 mixer one Mamba head of its inner segments and one group of its B and C
    (`_mixer_unit`); in a module with block-diagonal weights (h, w, w) split by blocks (a recurrence's gates per
    head, RecurrentGemma's), one block of w (`_block_units`); one feature elsewhere. A segment of U units puts
    ceil(U / ws) of them on the largest rank. Parameters the plan keeps whole count whole. The reference for
    "within one unit of balanced".
    """
    cfg = model.config
    mixer_unit, blocks = _mixer_unit(cfg), _block_units(sm)

    def heads_of(name: str) -> Optional[int]:  # an encoder-decoder's two stacks may differ in heads
        side = next((f"{s}_attention_heads" for s in ("encoder", "decoder") if f"{s}." in name), None)
        heads = getattr(cfg, side, None) if side else None
        return heads or getattr(cfg, "num_attention_heads", None)

    def head_dim_of(name: str) -> Optional[int]:
        heads = heads_of(name)
        found = getattr(cfg, "head_dim", None) or (cfg.hidden_size // heads if heads else None)
        return found or _module_int(model, name, "head_dim")

    def unit_of(name: str, seg: int) -> int:
        head_dim = head_dim_of(name)
        if not head_dim or seg % head_dim:
            return 1
        heads = _module_int(model, name, "num_heads") or heads_of(name)
        per_head = seg // heads if heads and seg % heads == 0 else 0
        if per_head > head_dim and per_head % head_dim == 0:
            return per_head  # a head wider than head_dim (q|k|v interleaved, MLA's q, a linear attention's)
        return head_dim

    sizes = {n: p.element_size() for n, p in model.named_parameters(remove_duplicate=False)}
    ws, total = sm.world_size, 0
    for n, pp in sm.plan.parameters.items():
        shape, item = tuple(pp.global_shape), sizes[n]
        if pp.dim is None:
            total += math.prod(shape) * item
            continue
        attn = any(w in n.lower() for w in ("attn", "attention"))
        block_heads = None if attn else _block_heads(model, n)
        rest = math.prod(shape) // shape[pp.dim]
        segments = _projections(pp, ws)
        for seg in segments or (shape[pp.dim],):
            unit = unit_of(n, seg) if attn else seg // block_heads if block_heads and seg % block_heads == 0 else 1
            if any(f".{m}." in n for m in ("mixer", "mamba")):
                unit = mixer_unit(seg)
            block = next((w for k, w in blocks.items() if n.startswith(k + ".") and seg % w == 0), None)
            unit = block or unit
            total += -(-seg // unit // ws) * unit * rest * item
    return total


def _block_heads(model: torch.nn.Module, name: str) -> Optional[int]:
    """`num_heads` of a leaf module (one without modules of its own) beside parameter `name`'s module: the heads of a
    multi-head block not named attention (xLSTM's mLSTM layer, whose per-head norm alone names them; not a decoder
    layer's feed-forward beside its attention, which holds its projections; not an embedding, whose unit is a row)."""
    path = name.split(".")[:-2]
    if isinstance(model.get_submodule(name.rsplit(".", 1)[0] if "." in name else ""), torch.nn.Embedding):
        return None
    block = model.get_submodule(".".join(path)) if path else model
    return next((h for m in block.children() if next(m.children(), None) is None
                 and isinstance(h := getattr(m, "num_heads", None), int)), None)


def _module_int(model: torch.nn.Module, name: str, attr: str) -> Optional[int]:
    """Attribute `attr` (an int) of the nearest module above parameter `name` that has one: `head_dim` for a model
    whose config keeps its head counts in per-part sub-configs (BLT's patcher, encoder, global transformer and
    decoder), `num_heads` for a module whose heads are laid out wider than the config's head_dim."""
    path = name.split(".")[:-1]
    while path:
        found = getattr(model.get_submodule(".".join(path)), attr, None)
        if isinstance(found, int):
            return found
        path.pop()
    return None


def _block_units(sm: Any) -> dict[str, int]:
    """Module path -> w for the modules holding (one level down) a block-diagonal weight (h, w, w) the plan splits by
    its blocks: a block cannot be cut without gathering it, so w is the unit of the projections around it (not
    experts' weights, square or not: an expert is the unit of its own weights only)."""
    out = {}
    for n, pp in sm.plan.parameters.items():
        shape = tuple(pp.global_shape)
        if pp.dim == 0 and len(shape) == 3 and shape[0] > 1 and shape[1] == shape[2] and "expert" not in n:
            out[n.rsplit(".", 2)[0]] = shape[1]
    return out


def _mixer_unit(cfg: Any) -> Any:
    """The unit of a Mamba-2 mixer's segment of `seg` features: a group's state (B and C, n_groups x d_state), a
    Mamba head (the inner segments, a multiple of its head dim), else one feature (per-head values, Mamba-1)."""
    def first(*keys: str) -> Optional[int]:
        return next((getattr(cfg, k) for k in keys if isinstance(getattr(cfg, k, None), int)), None)

    mamba2 = getattr(cfg, "model_type", "") == "mamba2"
    head = first("mamba_d_head", "mamba_head_dim", "mamba_headdim", *(("head_dim",) if mamba2 else ()))
    state = first("mamba_d_state", "ssm_state_size", *(("state_size",) if mamba2 else ()))
    groups = first("mamba_n_groups", "mamba_ngroups", "n_groups")

    def unit(seg: int) -> int:
        if state and groups and seg == state * groups:
            return state
        return head if head and seg % head == 0 else 1
    return unit


def _projections(pp: Any, ws: int) -> tuple[int, ...]:
    """The segments of a plan's split, a kv group's query heads cut among the ranks sharing its kv head (one piece a
    rank, `rank_cuts`) merged into one projection (the q of a fused q|k|v; k and v, in kv pieces, stay apart)."""
    sl = pp.slice()
    if sl is None or not sl.rank_cuts:
        return tuple(pp.segments or ())
    groups = sum(s for s, c in zip(sl.segments, sl.cuts) if len(c) == ws + 1)
    return (groups, *(s for s, c in zip(sl.segments, sl.cuts) if len(c) != ws + 1))


def held_share(model: torch.nn.Module, sm: Any) -> float:
    """The share of the parameter bytes one rank holds."""
    local, total = param_bytes(model, sm)
    return local / total
