"""The bundled examples, sharded at 1, 2 and 4 ranks, compute what the original computes."""
from __future__ import annotations

import re

import warnings

import pytest
import torch

import tpcompile
from tpcompile.models import GPT, GPTConfig, build

GPTS = ["gpt", "gpt-manual", "gpt-sep"]


def _idx(b: int, t: int) -> torch.Tensor:
    return torch.randint(0, 256, (b, t))


@pytest.mark.parametrize("ws", [1, 2, 4])
@pytest.mark.parametrize("name", ["mlp"] + GPTS)
def test_ranks_equal_original(name: str, ws: int) -> None:
    """Every rank's output equals the unsharded model (1e-5), on new batch and length too."""
    model = build(name)
    sm = tpcompile.shard(model, ws, example_inputs=model.example_inputs())
    inputs = [(torch.randn(3, 64),), (torch.randn(9, 64),)] if name == "mlp" else [(_idx(2, 16),), (_idx(3, 37),)]
    with torch.no_grad():
        for args in inputs:
            ref = model(*args)
            outs = tpcompile.simulate(sm, *args)
            assert len(outs) == ws
            for o in outs:
                assert o.shape == ref.shape
                torch.testing.assert_close(o, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", GPTS)
@pytest.mark.parametrize("ws", [2, 4])
def test_two_all_reduces_per_block(name: str, ws: int) -> None:
    """Each transformer block does exactly 2 forward all-reduces and no all-gather."""
    sm = tpcompile.shard(build(name), ws)
    per_block: dict[str, list[str]] = {}
    outside = []
    for op, path in sm.collectives():
        m = re.match(r"transformer\.h\.(\d+)", path)
        (per_block.setdefault(m.group(1), []) if m else outside).append(op)
    assert sorted(per_block) == ["0", "1"]
    for ops in per_block.values():
        assert ops == ["all_reduce", "all_reduce"]
    # one for the vocabulary-split embedding, one gather of the logits
    assert sorted(outside) == ["all_gather_replicated", "all_reduce"]


@pytest.mark.parametrize("ws", [2, 4])
def test_matmul_weights_hold_a_world_size_share(ws: int) -> None:
    """Column and row weights on each rank hold exactly 1/world_size of their bytes."""
    model = build("gpt")
    sm = tpcompile.shard(model, ws)
    full = dict(model.named_parameters())
    split = [p for p in sm.plan.parameters.values() if p.role in ("column", "row", "vocab")]
    assert len(split) >= 4 * 2 + 1
    for r in range(ws):
        local = dict(sm.rank(r).named_parameters(remove_duplicate=False))
        for p in split:
            assert local[p.name].nbytes * ws == full[p.name].nbytes, p.name
    blocks = [p for p in split if ".h." in p.name and p.name.endswith("weight")]
    assert {p.role for p in blocks} == {"column", "row"}


def test_rank_slices_tile_each_parameter() -> None:
    """Concatenating the ranks' slices gives back every split parameter exactly."""
    model = build("gpt-sep")
    sm = tpcompile.shard(model, 2)
    for name, p in sm.plan.parameters.items():
        pieces = [dict(sm.rank(r).named_parameters())[name] for r in range(2)] if name in dict(sm.rank(0).named_parameters()) else None
        if pieces is None or p.dim is None:
            continue
        torch.testing.assert_close(torch.cat(pieces, dim=p.dim), dict(model.named_parameters())[name], atol=0, rtol=0)


def test_fused_qkv_is_sliced_per_segment() -> None:
    """A fused q|k|v weight gives each rank its share of q, of k and of v."""
    model = build("gpt")
    sm = tpcompile.shard(model, 2)
    name = "transformer.h.0.attn.c_attn.weight"
    assert sm.plan.parameters[name].segments == (64, 64, 64)
    w = dict(model.named_parameters())[name]
    local = dict(sm.rank(1).named_parameters())[name]
    torch.testing.assert_close(local, torch.cat([w[32:64], w[96:128], w[160:192]]), atol=0, rtol=0)


def test_tied_weights_stay_one_parameter() -> None:
    """The tied embedding / lm_head weight is one parameter object on each rank."""
    sm = tpcompile.shard(build("gpt"), 2)
    gm = sm.rank(0)
    assert gm.get_parameter("lm_head.weight") is gm.get_parameter("transformer.wte.weight")
    assert gm.get_parameter("lm_head.weight").shape == (128, 64)


def test_head_count_not_divisible_is_padded_by_whole_heads() -> None:
    """6 heads at 4 ranks: q, k and v each padded to 8 heads, 2 a rank (the last rank one real head), no warning."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_head=6, n_embd=48)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, 4)
    assert sm.plan.modules["transformer.h.0.attn.c_attn"] == "column"
    assert sm.plan.parameters["transformer.h.0.attn.c_attn.weight"].padded == (64, 64, 64)
    assert sm.plan.modules["transformer.h.0.mlp.c_fc"] == "column"
    idx = _idx(2, 13)
    with torch.no_grad():
        ref = model(idx)
        for o in tpcompile.simulate(sm, idx):
            torch.testing.assert_close(o, ref, atol=1e-5, rtol=0)


def test_summary_lists_every_parameter_and_the_collectives() -> None:
    """summary() names each parameter with its split and counts the collectives."""
    model = build("gpt")
    sm = tpcompile.shard(model, 2)
    text = sm.summary()
    for name, _ in model.named_parameters():
        assert name in text
    assert "5 all_reduce" in text and "1 all_gather_replicated" in text
    assert len(sm) == 2 and [type(g).__name__ for g in sm] == ["ShardedRank0", "ShardedRank1"]
    assert sm[1] is sm.rank(1)


def test_plan_replicate_and_sharded_output() -> None:
    """plan={'lm_head': 'sharded_output'} keeps each rank's vocabulary slice of the logits."""
    model = build("gpt")
    sm = tpcompile.shard(model, 2, plan={"lm_head": "sharded_output", "transformer.h.1.mlp": "replicate"})
    assert sm.plan.modules["transformer.h.1.mlp.c_fc"] == "replicated"
    idx = _idx(2, 9)
    with torch.no_grad():
        ref = model(idx)
        outs = tpcompile.simulate(sm, idx)
    torch.testing.assert_close(torch.cat(outs, dim=-1), ref, atol=1e-5, rtol=0)
