"""Model code from popular libraries that once sharded wrongly or not at all: Falcon (tensor literals in
forward, weights read as `x @ W.T`) and a PEFT LoRA-wrapped Llama (a forward taking **kwargs)."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import tpcompile

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
transformers.logging.set_verbosity_error()
SIZES = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)


def _shard(model: torch.nn.Module, ws: int, **kwargs: object) -> tpcompile.ShardedModel:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tpcompile.TPCompileWarning)
        return tpcompile.shard(model, ws, example_kwargs=kwargs)


@pytest.mark.parametrize("ws", [2, 4])
def test_falcon_equals_the_original(ws: int) -> None:
    """Falcon (torch.tensor literals, FalconLinear's `x @ W.T`): every rank equals the original, its MLPs split."""
    torch.manual_seed(0)
    model = transformers.FalconForCausalLM(transformers.FalconConfig(**SIZES)).eval()
    sm = _shard(model, ws, input_ids=torch.randint(0, 128, (2, 8)), use_cache=False)
    assert sm.plan.modules["transformer.h.0.mlp.dense_h_to_4h"] == "column"
    assert sm.plan.modules["transformer.h.0.mlp.dense_4h_to_h"] == "row"
    ids = torch.randint(0, 128, (3, 6))
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
        outs = tpcompile.simulate(sm, input_ids=ids, use_cache=False)
    for out in outs:
        torch.testing.assert_close(out.logits, ref, atol=1e-4, rtol=1e-4)


def _lora_llama(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES, intermediate_size=128,
                                                                  num_key_value_heads=2)).to(dtype)
    cfg = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                          target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
    model = peft.get_peft_model(base, cfg)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero; give it values so the adapters matter
            torch.nn.init.normal_(p, std=0.02)
    return model


@pytest.mark.parametrize("ws", [2, 4])
def test_peft_lora_llama_splits_adapters_with_their_base(ws: int) -> None:
    """LoRA on a column-split weight: A whole, B split like the base; on a row-split weight: A split like the
    base, B whole (Megatron's layout, no warning); every rank equals the original."""
    model = _lora_llama().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, ws, example_kwargs={"input_ids": torch.randint(0, 128, (2, 8)), "use_cache": False})
    layer = "base_model.model.model.layers.1."
    roles = {k[len(layer):]: v for k, v in sm.plan.modules.items() if k.startswith(layer)}
    assert roles["self_attn.q_proj.base_layer"] == "column" and roles["self_attn.q_proj.lora_B.default"] == "column"
    assert roles["self_attn.q_proj.lora_A.default"] == "replicated"
    assert roles["self_attn.o_proj.base_layer"] == "row" and roles["self_attn.o_proj.lora_A.default"] == "row"
    assert roles["self_attn.o_proj.lora_B.default"] == "replicated"
    assert "low-rank down-projection" in sm.plan.replicated[layer + "self_attn.q_proj.lora_A.default"]
    ids = torch.randint(0, 128, (3, 6))
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
        outs = tpcompile.simulate(sm, input_ids=ids, use_cache=False)
    for out in outs:
        torch.testing.assert_close(out.logits, ref, atol=1e-5, rtol=1e-5)


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def test_peft_lora_llama_trains_like_the_original() -> None:
    """Three AdamW steps on the adapters (base frozen) give the original's losses on both ranks (float64)."""
    model = _lora_llama(torch.float64).train()
    ids = torch.randint(0, 128, (4, 12), generator=torch.Generator().manual_seed(1))
    kwargs = {"input_ids": ids, "use_cache": False}
    sm = _shard(model, 2, **kwargs)
    ranks = [sm.rank(r) for r in range(2)]
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    ref_losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = _loss(ref(**kwargs).logits, ids)
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    assert all(not p.requires_grad for n, p in ranks[0].named_parameters() if "lora" not in n)
    opts = [torch.optim.AdamW([p for p in gm.parameters() if p.requires_grad], lr=1e-2) for gm in ranks]

    def step(r: int) -> float:
        opts[r].zero_grad()
        loss = _loss(ranks[r](**kwargs).logits, ids)
        loss.backward()
        opts[r].step()
        return loss.item()

    losses = [tpcompile.simulate_ranks(2, step) for _ in range(3)]
    for want, got in zip(ref_losses, losses):
        assert got == pytest.approx([want, want], rel=1e-5)
    assert ref_losses[2] < ref_losses[0]  # the adapters learned something
