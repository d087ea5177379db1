"""The decode loop: attention over the filled cache in buckets, in-place step inputs, deferred eos checks, and the
rank graph trimmed for inference; tokens still equal Hugging Face generate's."""
from __future__ import annotations

from typing import Any

import pytest
import torch

import tpcompile
import tpcompile.generate.decode as decode_mod
from tpcompile.generate import shard_generation
from tpcompile.generate.masks import bucketed

from test_generate import padded_prompts, run_ranks
from bench.generate_matrix import small_model

NEW = 24


@pytest.fixture(scope="module")
def llama() -> tuple[torch.nn.Module, Any]:
    """Llama (2 kv heads) at 2 ranks, a cache of 2 rows x 40 tokens, attention in buckets of 8 positions."""
    model = small_model("llama")
    gen = shard_generation(model, 2, max_seq_len=40, max_batch_size=2)
    for r in range(2):
        gen.rank(r).bucket = 8
    return model, gen


def test_attention_reads_the_filled_cache_rounded_up_to_buckets(llama: tuple) -> None:
    """Each call's masks (and the cache attention reads) cover the filled positions rounded up to 8, not all 40;
    the tokens equal HF generate's."""
    model, gen = llama
    ids, mask = padded_prompts()
    lengths: list[int] = []
    hook = gen.rank(0).module.register_forward_pre_hook(lambda m, args: lengths.append(args[3]["mask"].shape[-1]))
    try:
        outs = run_ranks(gen, input_ids=ids, attention_mask=mask, max_new_tokens=NEW)
    finally:
        hook.remove()
    want = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    for out in outs:
        assert torch.equal(out, want)
    calls = want.shape[1] - 7  # the prompt's, then one per new token but the last
    assert calls > 20  # (one row runs long: the cache fills past three buckets)
    decode_positions = range(7, 7 + calls - 1)  # each fed token's cache position
    assert lengths == [bucketed(7, 8, 39)] + [bucketed(p + 1, 8, 39) for p in decode_positions]
    assert lengths[0] == 8 and lengths[-1] == 32 and len(set(lengths)) == 4


def test_end_of_sequence_checked_every_few_steps_stops_where_hf_stops(llama: tuple,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """With the eos flag read every 3 steps (as on a GPU), a row ending at its 5th token gives HF's 5 tokens."""
    model, gen = llama
    ids = padded_prompts()[0][:1]
    free = run_ranks(gen, input_ids=ids, max_new_tokens=NEW, eos_token_id=[])[0]
    eos = int(free[0, 7 + 4])
    assert eos not in free[0, 7:7 + 4].tolist()  # (the 5th token is the first of its kind)
    monkeypatch.setattr(decode_mod, "sync_interval", lambda device: 3)
    outs = run_ranks(gen, input_ids=ids, max_new_tokens=NEW, eos_token_id=eos)
    want = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=eos)
    assert want.shape[1] == 7 + 5
    for out in outs:
        assert torch.equal(out, want)
    assert gen.rank(0).stats.new_tokens == 5 and len(gen.rank(0).stats.decode_s) == 4


def test_generate_loop_calls_a_trimmed_copy_sharing_the_cache(llama: tuple) -> None:
    """The generate loop's graph has no guards, dtype asserts or gradient markers and calls the collectives
    directly, holds the rank graph's very cache tensors, and computes the rank graph's logits."""
    _, gen = llama
    full, trimmed = gen.sharded.rank(0), gen.rank(0).module
    targets = {str(n.target) for n in trimmed.graph.nodes}
    assert not any("assert_tensor_metadata" in t or "grad_all_reduce" in t or "tpcompile." in t for t in targets)
    assert not [n for n in trimmed.graph.nodes if n.op == "call_module"]
    assert len(trimmed.graph.nodes) < len(full.graph.nodes)
    assert trimmed.kv.k0.data_ptr() == full.kv.k0.data_ptr()
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(4))
    pos, cache_pos = torch.arange(5).expand(2, 5), torch.arange(5)
    masks = {"mask": torch.ones(2, 1, 5, 8, dtype=torch.bool).tril()}
    a, b = tpcompile.simulate_ranks(2, lambda r: (gen.sharded.rank(r)(ids, pos, cache_pos, masks),
                                                  gen.rank(r).module(ids, pos, cache_pos, masks)))[0]
    assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_sliding_windows_slide_in_place_across_buckets(arch: str) -> None:
    """Sliding-window layers (mistral: every layer; gemma3: one of two) with buckets of 4 positions: the masks
    updated in place each step give HF generate's tokens."""
    model = small_model(arch)
    gen = shard_generation(model, 2, max_seq_len=40, max_batch_size=2)
    for r in range(2):
        gen.rank(r).bucket = 4
    ids, mask = padded_prompts()
    want = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    for out in run_ranks(gen, input_ids=ids, attention_mask=mask, max_new_tokens=NEW):
        assert torch.equal(out, want)
