"""Generation with a KV cache on sharded ranks: tokens equal to Hugging Face generate, the cache split by heads."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import tpcompile
from tpcompile.generate import shard_generation
from tpcompile.ops.collectives import record

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from bench.generate_matrix import small_model  # noqa: E402  (the architectures of the slow matrix)

NEW = 32


def padded_prompts(vocab: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts of 7 and 4 tokens, the shorter one left-padded, and their attention mask."""
    ids = torch.randint(3, vocab, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 7, dtype=torch.long)
    ids[1, :3], mask[1, :3] = 0, 0
    return ids, mask


def run_ranks(gen: Any, **kwargs: Any) -> list[torch.Tensor]:
    """Every simulated rank's generate(**kwargs)."""
    return tpcompile.simulate_ranks(gen.world_size, lambda r: gen.rank(r).generate(**kwargs))


@pytest.fixture(scope="module")
def llama() -> tuple[torch.nn.Module, Any]:
    """Llama (2 kv heads) sharded over 2 ranks with a cache of 2 rows x 48 tokens."""
    model = small_model("llama")
    return model, shard_generation(model, 2, max_seq_len=48, max_batch_size=2)


def test_greedy_tokens_equal_hf_generate_for_padded_prompts(llama: tuple) -> None:
    """32 greedy tokens for 2 prompts of different lengths equal HF generate's on both ranks; each holds half the
    cache."""
    model, gen = llama
    ids, mask = padded_prompts()
    want = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    outs = run_ranks(gen, input_ids=ids, attention_mask=mask, max_new_tokens=NEW)
    assert want.shape[1] > 7 + 8  # (the model's eos did not end the rows at once)
    for out in outs:
        assert torch.equal(out, want)
    assert gen.cache_bytes(0) == gen.cache_bytes(1) == gen.unsharded_cache_bytes // 2
    # the cache buffers, (rows, kv heads, max_seq_len, head dim), are held by heads
    assert gen.sharded.rank(0).kv.k0.shape == (2, 1, 48, 16)


def test_eos_ends_rows_as_hf_generate_does(llama: tuple) -> None:
    """A row that produces eos_token_id is padded afterwards and the call ends when all rows have; tokens equal HF's."""
    model, gen = llama
    ids, mask = padded_prompts()
    free = run_ranks(gen, input_ids=ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=[])[0]
    eos = int(free[0, 7 + 2])  # row 0's third new token
    want = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=eos)
    outs = run_ranks(gen, input_ids=ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=eos)
    assert want.shape[1] < 7 + NEW or (want[:, 7:] == eos).any()
    for out in outs:
        assert torch.equal(out, want)


def test_sampling_with_a_seed_draws_the_same_tokens_on_every_rank(llama: tuple) -> None:
    """do_sample with top-k, top-p and temperature: every rank draws the same tokens; the seed decides them."""
    _, gen = llama
    ids, mask = padded_prompts()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=True, temperature=0.9, top_k=40,
              top_p=0.95, eos_token_id=[])
    first, again, other = (run_ranks(gen, seed=s, **kw) for s in (7, 7, 8))
    assert torch.equal(first[0], first[1]) and torch.equal(first[0], again[1])
    assert not torch.equal(first[0], other[0])
    unseeded = run_ranks(gen, **kw)  # rank 0 draws a seed and shares it
    assert torch.equal(unseeded[0], unseeded[1])


def test_decode_step_costs_the_same_at_any_length_and_communicates_megatron_style(llama: tuple) -> None:
    """Each decode step feeds one token, does the same matmul FLOPs at step 2 and step 30, and issues two
    all-reduces per block and one gather of the logits (the untied token embedding is whole on every rank)."""
    from torch.utils.flop_counter import FlopCounterMode

    _, gen = llama
    ids, mask = padded_prompts()
    seen: list[tuple] = []
    module = gen.rank(0).module  # the graph the generate loop calls

    def rank(r: int) -> list[int]:
        flops = []
        for n in (1, 2, 10, 11):
            with FlopCounterMode(display=False) as counter:
                gen.rank(r).generate(ids, attention_mask=mask, max_new_tokens=n, eos_token_id=[])
            flops.append(counter.get_total_flops())
        return flops

    hook = module.register_forward_pre_hook(lambda m, args: seen.append(tuple(args[0].shape)))
    try:
        f1, f2, f10, f11 = tpcompile.simulate_ranks(2, rank)[0]
        with record() as events:
            tpcompile.simulate_ranks(2, lambda r: gen.rank(r).generate(ids, attention_mask=mask, max_new_tokens=2,
                                                                       eos_token_id=[]))
    finally:
        hook.remove()
    assert f2 - f1 == f11 - f10 > 0 and f1 > f2 - f1  # a later step costs what an early one does; prefill more
    assert seen[-2:] == [(2, 7), (2, 1)]  # the prompt, then one token per step
    ops = [e.op for e in events if e.rank == 0]
    per_step = ops[: len(ops) // 2]
    assert ops[len(ops) // 2:] == per_step  # prefill and decode communicate alike
    assert per_step.count("all_reduce") == 2 * 2 and per_step.count("all_gather_replicated") == 1
    assert len(per_step) == 5
    assert gen.sharded.plan.modules["model.model.embed_tokens"] == "replicated"


def test_past_max_seq_len_is_a_clear_error(llama: tuple) -> None:
    """A prompt plus new tokens longer than the cache raises TPCompileError naming max_seq_len and the way out."""
    _, gen = llama
    ids, mask = padded_prompts()
    with pytest.raises(tpcompile.TPCompileError, match=r"7 \+ max_new_tokens 42 = 49 tokens exceed .*max_seq_len=48"):
        gen.rank(0).generate(ids, attention_mask=mask, max_new_tokens=42)
    with pytest.raises(tpcompile.TPCompileError, match="max_batch_size=2"):
        gen.rank(0).generate(torch.zeros(3, 4, dtype=torch.long), max_new_tokens=1)


def test_bundled_gpt_greedy_equals_recomputing_the_sequence() -> None:
    """The bundled GPT at 2 ranks: greedy tokens equal the unsharded model's argmax over the whole sequence."""
    from tpcompile.models import build

    model = build("gpt")
    gen = shard_generation(model, 2, max_seq_len=40)
    assert gen.sharded.plan.modules["model.transformer.wpe"] == "replicated"  # positions: no all-reduce per step
    prompt = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(2))
    want = prompt
    with torch.no_grad():
        for _ in range(NEW):
            want = torch.cat([want, model(want)[:, -1].argmax(-1, keepdim=True)], dim=1)
    for out in run_ranks(gen, input_ids=prompt, max_new_tokens=NEW):
        assert torch.equal(out, want)
    assert gen.cache_bytes(1) == gen.unsharded_cache_bytes // 2


def test_cli_generate_prints_both_token_lists_and_agrees(capsys: pytest.CaptureFixture) -> None:
    """`tpcompile generate gpt -w 2 --batch 2` prints the unsharded and rank 0 tokens per prompt, times, OK."""
    from tpcompile.cli.main import main

    code = main(["generate", "gpt", "-w", "2", "--prompt-len", "5", "--max-new-tokens", "6", "--batch", "2",
                 "--config", "n_layer=1"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.count("  unsharded: [") == 2 and out.count("  rank 0:    [") == 2
    assert "time to first token" in out and "tokens/s" in out and "cache per rank" in out
    assert "OK: all 2 ranks generated the unsharded model's tokens" in out


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_three_ranks_split_the_cache_of_four_heads(kv_heads: int) -> None:
    """4 query heads at 3 ranks (kv heads 4 or 2, neither divisible by 3): no warning, HF's greedy tokens on every
    rank, and no rank holds more than half the cache (heads padded to 2 a rank)."""
    gen = greedy_llama(3, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=kv_heads)
    assert max(gen.cache_bytes(r) for r in range(3)) <= gen.unsharded_cache_bytes // 2


def greedy_llama(world_size: int, new_tokens: int = 20, **config: int) -> Any:
    """A 2-layer Llama of `config` sharded for generation at `world_size` without a warning, every rank's greedy
    tokens checked against HF generate's; the generator."""
    import warnings

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, num_hidden_layers=2, **config)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpcompile.TPCompileWarning)
        gen = shard_generation(model, world_size, max_seq_len=48, max_batch_size=2)
    ids, mask = padded_prompts()
    want = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    for out in run_ranks(gen, input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens):
        assert torch.equal(out, want)
    return gen
