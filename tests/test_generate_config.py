"""Generation honours or refuses the model's config: attention locality, generation_config, architectures it cannot
run, and weights= for a model built on the meta device; every honoured case gives Hugging Face generate's tokens."""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import transformers as t

import tpcompile
from tpcompile.generate import shard_generation

from test_generate import padded_prompts, run_ranks
from bench.generate_matrix import small_model

t.logging.set_verbosity_error()
NEW = 24
SIZES = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
             vocab_size=128, max_position_embeddings=64)


def seeded(build: Any) -> torch.nn.Module:
    """build() with random weights from seed 0, eval mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return build().eval()


def same_as_hf(model: torch.nn.Module, gen: Any = None, prompt: Any = None, **kwargs: Any) -> torch.Tensor:
    """Assert every rank's greedy tokens equal model.generate(do_sample=False)'s (past windows: 7 + 24 tokens);
    HF's tokens back."""
    gen = gen or shard_generation(model, 2, max_seq_len=40, max_batch_size=2)
    ids, mask = padded_prompts() if prompt is None else prompt
    want = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, **kwargs)
    for out in run_ranks(gen, input_ids=ids, attention_mask=mask, max_new_tokens=NEW, **kwargs):
        assert torch.equal(out, want)
    return want


def llama4(chunk: int) -> torch.nn.Module:
    """Llama4 text: a chunked layer (attention_chunk_size) and a full one."""
    return seeded(lambda: t.Llama4ForCausalLM(t.Llama4TextConfig(
        **SIZES, head_dim=16, intermediate_size_mlp=128, attention_chunk_size=chunk, num_local_experts=2,
        no_rope_layers=[1, 0])))


def test_chunked_attention_gives_hf_tokens_past_the_chunk() -> None:
    """Llama4's layer_types "chunked_attention" with attention_chunk_size=8: HF's tokens, which a causal mask misses."""
    model = llama4(8)
    assert model.config.layer_types == ["chunked_attention", "full_attention"]
    want = same_as_hf(model)
    wide = llama4(64)  # the same weights, chunks longer than the sequence
    ids, mask = padded_prompts()
    assert not torch.equal(wide.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False), want)


@pytest.mark.parametrize("max_window_layers, types", [(1, ["full_attention", "sliding_attention"]),
                                                      (2, ["full_attention", "full_attention"])])
def test_qwen2_use_sliding_window_and_max_window_layers(max_window_layers: int, types: list) -> None:
    """qwen2's use_sliding_window / max_window_layers: sliding layers from max_window_layers on, and with none a
    sliding_window that is set changes nothing; HF's tokens either way."""
    model = seeded(lambda: t.Qwen2ForCausalLM(t.Qwen2Config(**SIZES, use_sliding_window=True, sliding_window=4,
                                                             max_window_layers=max_window_layers)))
    assert model.config.layer_types == types and model.config.sliding_window == 4
    same_as_hf(model)


def gpt_neo() -> torch.nn.Module:
    """GPT-Neo with a global and a local layer (window_size 8)."""
    return seeded(lambda: t.GPTNeoForCausalLM(t.GPTNeoConfig(
        num_layers=2, hidden_size=64, num_heads=4, vocab_size=128, max_position_embeddings=64, window_size=8,
        attention_types=[[["global", "local"], 1]])))


def bidirectional_gemma3() -> torch.nn.Module:
    """gemma3 text with use_bidirectional_attention."""
    return seeded(lambda: t.Gemma3ForCausalLM(t.Gemma3TextConfig(**SIZES, head_dim=16, sliding_window=8,
                                                                  use_bidirectional_attention=True)))


def falcon_mamba() -> torch.nn.Module:
    """Falcon-Mamba: a state-space model (no attention, a recurrent and a convolution state)."""
    return seeded(lambda: t.FalconMambaForCausalLM(t.FalconMambaConfig(
        num_hidden_layers=2, hidden_size=64, state_size=8, vocab_size=128)))


def bloom() -> torch.nn.Module:
    """BLOOM: ALiBi biases built from the 2-D attention mask."""
    return seeded(lambda: t.BloomForCausalLM(t.BloomConfig(n_layer=2, hidden_size=64, n_head=4, vocab_size=128)))


@pytest.mark.parametrize("build, names", [
    (gpt_neo, ["config.attention_layers='local'", "window_size=8"]),
    (bidirectional_gemma3, ["config.use_bidirectional_attention=True"]),
    (falcon_mamba, ["config.layer_types='linear_attention'", "a recurrent state"]),
    (bloom, ["ALiBi"]),
])
def test_what_cannot_be_honoured_is_refused_at_shard_time(build: Any, names: list) -> None:
    """Locality the masks cannot give, and architectures the cache cannot run: a TPCompileError at shard time
    naming the field or the reason (HF's own generate runs every one of them)."""
    model = build()
    ids, mask = padded_prompts()
    model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    with pytest.raises(tpcompile.TPCompileError) as err:
        shard_generation(model, 2, max_seq_len=40, max_batch_size=2)
    for name in names:
        assert name in str(err.value)


@pytest.fixture(scope="module")
def llama() -> tuple[torch.nn.Module, Any]:
    """Llama at 2 ranks without an eos id, so rows run to the end unless a case sets one (its generation_config is
    read at each call, as generate reads it)."""
    model = small_model("llama")
    model.generation_config.eos_token_id = None
    return model, shard_generation(model, 2, max_seq_len=40, max_batch_size=2)


def first_free_token(model: torch.nn.Module, at: int) -> int:
    """Row 0's greedy token `at` (new tokens counted from 0) under the default generation_config."""
    ids, mask = padded_prompts()
    return int(model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)[0, 7 + at])


HONOURED = {
    "repetition_penalty": lambda m: dict(repetition_penalty=1.5),
    "encoder_repetition_penalty": lambda m: dict(encoder_repetition_penalty=1.5),
    "no_repeat_ngram_size": lambda m: dict(no_repeat_ngram_size=2),
    "suppress_tokens": lambda m: dict(suppress_tokens=[first_free_token(m, 0), first_free_token(m, 1)]),
    "begin_suppress_tokens": lambda m: dict(begin_suppress_tokens=[first_free_token(m, 0)]),
    "bad_words_ids": lambda m: dict(bad_words_ids=[[first_free_token(m, 1)]]),
    "sequence_bias": lambda m: dict(sequence_bias={(first_free_token(m, 2),): -20.0}),
    "forced_eos_token_id": lambda m: dict(forced_eos_token_id=6, eos_token_id=[6]),
    "min_new_tokens": lambda m: dict(eos_token_id=[first_free_token(m, 2)], min_new_tokens=8),
    "min_length": lambda m: dict(eos_token_id=[first_free_token(m, 2)], min_length=7 + 8),
    "exponential_decay_length_penalty": lambda m: dict(eos_token_id=[9], exponential_decay_length_penalty=(2, 3.0)),
    "eos_token_id list, pad_token_id": lambda m: dict(eos_token_id=[first_free_token(m, 3), first_free_token(m, 5)],
                                                      pad_token_id=7),
    "renormalize_logits": lambda m: dict(renormalize_logits=True, repetition_penalty=1.5),
}


@pytest.mark.parametrize("case", sorted(HONOURED))
def test_generation_config_fields_give_hf_greedy_tokens(llama: tuple, case: str) -> None:
    """The model's generation_config field applies as HF's logits processors apply it: every rank's greedy tokens
    equal model.generate(do_sample=False)'s, and differ from those of the default config."""
    model, gen = llama
    plain = same_as_hf(model, gen)
    fields = HONOURED[case](model)
    saved = copy.deepcopy(model.generation_config)
    try:
        for k, v in fields.items():
            setattr(model.generation_config, k, v)
        changed = same_as_hf(model, gen)
    finally:
        model.generation_config = saved
    assert not torch.equal(changed, plain)


def test_forced_bos_token_for_a_one_token_prompt(llama: tuple) -> None:
    """forced_bos_token_id applies when the prompt is one token long: HF's tokens, starting with it."""
    model, gen = llama
    saved = copy.deepcopy(model.generation_config)
    try:
        model.generation_config.forced_bos_token_id = 5
        want = same_as_hf(model, gen, prompt=(padded_prompts()[0][:, -1:], torch.ones(2, 1, dtype=torch.long)))
    finally:
        model.generation_config = saved
    assert (want[:, 1] == 5).all()


@pytest.mark.parametrize("fields", [dict(typical_p=1e-6), dict(min_p=0.999), dict(epsilon_cutoff=0.9),
                                    dict(top_k=1, temperature=0.5)])
def test_sampling_fields_of_generation_config_apply(llama: tuple, fields: dict) -> None:
    """do_sample=True in the generation_config and the call, a warper that keeps one token, temperature not given: every
    rank's draws equal HF's sampled generate (both deterministic), and differ from greedy for typical_p."""
    model, gen = llama
    saved = copy.deepcopy(model.generation_config)
    try:
        model.generation_config.do_sample = True
        for k, v in fields.items():
            setattr(model.generation_config, k, v)
        ids, mask = padded_prompts()
        want = model.generate(ids, attention_mask=mask, max_new_tokens=NEW)
        outs = run_ranks(gen, input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True, seed=3)
        for out in outs:
            assert torch.equal(out, want)
        kinds = {type(p).__name__ for p in gen.spec.decoding.prepare(ids, mask, NEW).processors}
        assert {"TopKLogitsWarper"} <= kinds  # generation_config's default top_k=50 applies when sampling
    finally:
        model.generation_config = saved


def test_sampling_defaults_come_from_generation_config(llama: tuple) -> None:
    """A call with do_sample=True and no temperature / top_p takes the generation_config's 0.7, 0.9 and eta_cutoff,
    and top_k's default 50, as HF does; greedy leaves the warpers out."""
    model, gen = llama
    saved = copy.deepcopy(model.generation_config)
    try:
        model.generation_config.temperature, model.generation_config.top_p = 0.7, 0.9
        model.generation_config.eta_cutoff = 0.01
        ids, mask = padded_prompts()
        done = gen.spec.decoding.prepare(ids, mask, NEW, do_sample=True)
        found = {type(p).__name__: p for p in done.processors}
        assert done.do_sample and found["TemperatureLogitsWarper"].temperature == 0.7
        assert found["TopPLogitsWarper"].top_p == 0.9 and found["TopKLogitsWarper"].top_k == 50
        assert found["EtaLogitsWarper"].epsilon == 0.01
        assert len(gen.spec.decoding.prepare(ids, mask, NEW).processors) == 0
        a, b = run_ranks(gen, input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=True, seed=5)
        assert torch.equal(a, b)
    finally:
        model.generation_config = saved


@pytest.mark.parametrize("field, value", [
    ("num_beams", 2), ("penalty_alpha", 0.6), ("num_return_sequences", 2), ("guidance_scale", 1.5),
    ("max_time", 1.0), ("stop_strings", ["end"]), ("prompt_lookup_num_tokens", 3), ("dola_layers", "high"),
    ("token_healing", True), ("cache_implementation", "quantized"),
])
def test_generation_config_fields_not_honoured_are_refused_at_shard_time(field: str, value: Any) -> None:
    """A generation_config field that asks for another decoding method or for what the ranks lack: a TPCompileError
    at shard_generation time naming the field and the value."""
    model = small_model("llama")
    setattr(model.generation_config, field, value)
    with pytest.raises(tpcompile.TPCompileError, match=rf"generation_config\.{field}={value!r}".replace("[", r"\[")):
        shard_generation(model, 2, max_seq_len=40, max_batch_size=2)


def meta_llama() -> torch.nn.Module:
    """small_model('llama')'s architecture built on the meta device, its rotary module real (a non-persistent
    buffer no weights file holds)."""
    config = small_model("llama").config
    with torch.device("meta"):
        model = t.LlamaForCausalLM(config).eval()
    model.model.rotary_emb = t.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    return model


@pytest.mark.parametrize("source", ["state dict", "safetensors"])
def test_meta_model_with_weights_gives_the_in_memory_models_tokens(source: str, tmp_path: Any) -> None:
    """shard_generation(meta model, weights=...): each rank reads its slices (half the cache, real tensors), and
    the tokens equal the in-memory model's HF generate."""
    from safetensors.torch import save_model

    model = small_model("llama")
    weights: Any = model.state_dict()
    if source == "safetensors":
        save_model(model, str(tmp_path / "model.safetensors"))
        weights = tmp_path
    with pytest.raises(tpcompile.TPCompileError, match="meta device, so shard_generation needs weights="):
        shard_generation(meta_llama(), 2, max_seq_len=40, max_batch_size=2)
    gen = shard_generation(meta_llama(), 2, max_seq_len=40, max_batch_size=2, weights=weights)
    same_as_hf(model, gen)
    rank = gen.rank(1).module
    assert not any(x.is_meta for x in list(rank.parameters()) + list(rank.buffers()))
    assert gen.cache_bytes(1) == gen.unsharded_cache_bytes // 2
