"""Hugging Face architectures shard automatically and equal the original."""
from __future__ import annotations

import re

import warnings

import pytest
import torch

import tpcompile

pytest.importorskip("transformers")
from hf_models import ARCHS, build, inputs  # noqa: E402

LAYER = re.compile(r"(?:^|\.)(?:h|layers|layer)\.(\d+)(?:\.|$)")


def layer_of(path: str) -> str | None:
    """The decoder/encoder layer index a module path lies in, if any."""
    m = LAYER.search(path)
    return m.group(1) if m else None


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("arch", ARCHS, ids=[a.name for a in ARCHS])
def test_hf_ranks_equal_original(arch, ws: int) -> None:
    """No warning; 2 forward collectives per layer, one for the embedding and one for the head; every
    rank's output equals the original within 1e-4 on a new batch and length."""
    model = build(arch)
    sm = tpcompile.shard(model, ws, example_kwargs=inputs(arch, 2, 8))
    assert not sm.plan.warnings
    per_layer: dict[str, list[str]] = {}
    outside: list[str] = []
    for op, path in sm.collectives():
        layer = layer_of(path)
        (per_layer.setdefault(layer, []) if layer is not None else outside).append(op)
    assert sorted(per_layer) == ["0", "1"], per_layer
    for ops in per_layer.values():
        assert ops == ["all_reduce", "all_reduce"]
    assert outside.count("all_reduce") <= 1 and outside.count("all_gather_replicated") <= 1
    assert len(outside) == 2, outside  # every model here splits its embedding and its head
    kw = inputs(arch, 3, 13)
    with torch.no_grad():
        ref = model(**kw)[arch.output]
        outs = tpcompile.simulate(sm, **kw)
    for r, out in enumerate(outs):
        assert type(out).__name__ == type(model(**kw)).__name__
        torch.testing.assert_close(out[arch.output], ref, atol=1e-4, rtol=0, msg=lambda m: f"rank {r}: {m}")


@pytest.mark.parametrize("ws", [2, 4])
def test_llama_one_kv_head_multi_query(ws: int) -> None:
    """1 kv head at 2 and 4 ranks (multi-query, as Megatron splits it): k/v whole on every rank, q heads
    and the output projection split, no warning, two all-reduces per block; outputs and gradients equal."""
    from hf_models import ARCHS as all_archs
    arch = next(a for a in all_archs if a.name == "llama")
    model = build(arch, num_key_value_heads=1)
    sm = tpcompile.shard(model, ws, example_kwargs=inputs(arch, 2, 8))
    assert not sm.plan.warnings
    params = sm.plan.parameters
    assert params["model.layers.0.self_attn.q_proj.weight"].local_shape == (64 // ws, 64)
    for proj in ("k_proj", "v_proj"):  # one head of 16, whole on every rank
        p = params[f"model.layers.0.self_attn.{proj}.weight"]
        assert (p.pieces, p.local_shape) == (1, (16, 64))
    assert sm.plan.modules["model.layers.0.self_attn.o_proj"] == "row"
    per_block = [".".join(path.split(".")[:3]) for op, path in sm.collectives() if path.startswith("model.layers.")]
    assert sorted(per_block) == ["model.layers.0"] * 2 + ["model.layers.1"] * 2, sm.collectives()
    kw = inputs(arch, 2, 11)
    with torch.no_grad():
        ref = model(**kw).logits
        for out in tpcompile.simulate(sm, **kw):
            torch.testing.assert_close(out.logits, ref, atol=1e-4, rtol=0)
    model.zero_grad()
    model(**kw).logits.pow(2).mean().backward()
    name = "model.layers.0.self_attn.k_proj.weight"
    want = dict(model.named_parameters())[name].grad
    ranks = [sm.rank(r) for r in range(ws)]

    def grad(r: int) -> torch.Tensor:
        ranks[r](**kw).logits.pow(2).mean().backward()
        return dict(ranks[r].named_parameters())[name].grad

    for r, got in enumerate(tpcompile.simulate_ranks(ws, grad)):  # every rank's queries' share, summed
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4, msg=lambda m: f"rank {r}: {m}")


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2"])
def test_kv_heads_fewer_than_ranks_are_shared_pieces(name: str) -> None:
    """2 kv heads at 4 ranks: each rank holds the one kv head its q heads use, no replication."""
    arch = next(a for a in ARCHS if a.name == name)
    model = build(arch)
    sm = tpcompile.shard(model, 4, example_kwargs=inputs(arch, 2, 8))
    assert not sm.plan.warnings
    for proj in ("k_proj", "v_proj"):
        p = sm.plan.parameters[f"model.layers.1.self_attn.{proj}.weight"]
        assert (p.role, p.pieces, p.local_shape) == ("column", 2, (16, 64))  # one head of 16
        w = dict(model.named_parameters())[p.name]
        for r in range(4):
            torch.testing.assert_close(sm.rank(r).get_parameter(p.name), w[16 * (r // 2): 16 * (r // 2 + 1)])
    kw = inputs(arch, 3, 13)
    with torch.no_grad():
        ref = model(**kw).logits
        for out in tpcompile.simulate(sm, **kw):
            torch.testing.assert_close(out.logits, ref, atol=1e-4, rtol=0)


def test_hf_gpt2_heads_not_divisible_are_padded_in_each_segment() -> None:
    """GPT-2 with 6 heads at 4 ranks: c_attn's q, k and v segments each padded to 8 heads, 2 a rank, no warning."""
    from hf_models import ARCHS as all_archs
    arch = next(a for a in all_archs if a.name == "gpt2")
    model = build(arch, n_head=6, n_embd=48)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, 4, example_kwargs=inputs(arch, 2, 8))
    p = sm.plan.parameters["transformer.h.0.attn.c_attn.weight"]
    assert (p.role, p.segments, p.padded, p.local_shape) == ("column", (48, 48, 48), (64, 64, 64), (48, 48))
    assert sm.plan.parameters["transformer.h.0.attn.c_proj.weight"].local_shape == (16, 48)
    kw = inputs(arch, 2, 9)
    with torch.no_grad():
        ref = model(**kw).logits
        for out in tpcompile.simulate(sm, **kw):
            torch.testing.assert_close(out.logits, ref, atol=1e-4, rtol=0)


def test_llama_heads_not_divisible_are_padded_by_whole_heads() -> None:
    """Llama with 6 heads at 4 ranks: heads padded to 8 (2 a rank, the last rank's zeros), no warning, attention and
    every MLP column -> row (RMSNorm between), exact on another batch and length."""
    arch = next(a for a in ARCHS if a.name == "llama")
    model = build(arch, hidden_size=96, num_attention_heads=6, num_key_value_heads=6)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, 4, example_kwargs=inputs(arch, 2, 8))
    for layer in range(2):
        plans = {p: sm.plan.parameters[f"model.layers.{layer}.{p}.weight"]
                 for p in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
        assert {p: pp.role for p, pp in plans.items()} == {
            "self_attn.q_proj": "column", "self_attn.o_proj": "row", "mlp.gate_proj": "column",
            "mlp.up_proj": "column", "mlp.down_proj": "row"}
        assert plans["self_attn.q_proj"].padded == 128 and plans["self_attn.q_proj"].local_shape == (32, 96)
    kw = inputs(arch, 3, 13)
    with torch.no_grad():
        ref = model(**kw).logits
        for out in tpcompile.simulate(sm, **kw):
            torch.testing.assert_close(out.logits, ref, atol=1e-4, rtol=0)


def test_gpt2_conv1d_and_tied_head() -> None:
    """GPT-2's Conv1D c_attn is sliced per q/k/v segment; wte and lm_head stay one parameter."""
    from hf_models import ARCHS as all_archs
    arch = next(a for a in all_archs if a.name == "gpt2")
    sm = tpcompile.shard(build(arch), 2, example_kwargs=inputs(arch, 2, 8))
    p = sm.plan.parameters["transformer.h.0.attn.c_attn.weight"]
    assert (p.role, p.dim, p.segments, p.local_shape) == ("column", 1, (64, 64, 64), (64, 96))
    gm = sm.rank(1)
    assert gm.get_parameter("lm_head.weight") is gm.get_parameter("transformer.wte.weight")
    assert gm.get_parameter("lm_head.weight").shape == (64, 64)
