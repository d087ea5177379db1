"""Per-rank weight loading: only this rank's slices, from a state dict, safetensors or a .pt file."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
from safetensors.torch import save_model

import tpcompile
from tpcompile.checkpoint.weights import load_rank_weights
from tpcompile.models import GPT, GPTConfig
from tpcompile.placement import ParamSlice, pad_cuts, piece_cut, rank_pieces

CFG = GPTConfig(attention="manual", vocab_size=250)


@functools.cache
def _meta_sharded(ws: int) -> tpcompile.ShardedModel:
    """A GPT built on meta, sharded at ws ranks (made once per world size for this file)."""
    with torch.device("meta"):
        model = GPT(CFG).eval()
    return tpcompile.shard(model, ws, example_inputs=(torch.zeros(2, 8, dtype=torch.long, device="meta"),))


def _meta_ranks(ws: int, weights) -> list:
    """Every rank of the meta-built GPT (fresh copies), each filled from `weights`."""
    sm = _meta_sharded(ws)
    return [load_rank_weights(copy.deepcopy(sm.rank(r)), sm, r, weights) for r in range(ws)]


def _check(ranks: list, model: torch.nn.Module) -> None:
    """Every rank's output equals the model's, at a batch and length not captured."""
    idx = torch.randint(0, model.config.vocab_size, (3, 11))
    outs = tpcompile.simulate_ranks(len(ranks), lambda r: ranks[r](idx))
    with torch.no_grad():
        for out in outs:
            torch.testing.assert_close(out, model(idx))


def test_rank_pieces() -> None:
    """Segments give one run per segment, padding is left out, a shared kv-head piece is whole."""
    assert rank_pieces(ParamSlice(0, (4, 4, 4)), 12, 1, 2) == [(2, 0, 2), (6, 2, 2), (10, 4, 2)]
    assert rank_pieces(ParamSlice(0, cuts=pad_cuts(252, 4)), 250, 3, 4) == [(189, 0, 61)]
    assert rank_pieces(piece_cut(1, 8, 2), 8, 3, 4) == [(4, 0, 4)]


def test_meta_model_from_state_dict_at_four_ranks() -> None:
    """Padded vocabulary (250 at 4), fused q|k|v: meta ranks filled from a state dict equal the model."""
    model = GPT(CFG).eval()
    ranks = _meta_ranks(4, model.state_dict())
    assert not any(t.is_meta for gm in ranks for t in gm.state_dict().values())
    assert ranks[3].lm_head.weight is ranks[3].transformer.wte.weight  # tied once
    assert ranks[3].lm_head.weight[61:].abs().sum() == 0  # the padding rows are zeros
    _check(ranks, model)


def test_meta_model_from_safetensors(tmp_path) -> None:
    """Slices read with safe_open(...).get_slice from a file equal the model's output at 2 ranks."""
    model = GPT(CFG).eval()
    save_model(model, str(tmp_path / "model.safetensors"))
    ranks = _meta_ranks(2, tmp_path)  # a directory of .safetensors files
    assert ranks[0].get_parameter("transformer.h.0.attn.c_attn.weight").shape == (96, 64)
    _check(ranks, model)


def test_pt_file_loads_weights_only(tmp_path) -> None:
    """A torch.save'd state dict loads (weights_only); a file with a pickled class is refused."""
    model = GPT(CFG).eval()
    torch.save(model.state_dict(), tmp_path / "w.pt")
    _check(_meta_ranks(2, tmp_path / "w.pt"), model)
    torch.save({"x": torch.nn.Linear(2, 2)}, tmp_path / "bad.pt")
    with pytest.raises(Exception, match="[Ww]eights only load failed"):
        _meta_ranks(2, tmp_path / "bad.pt")


def test_missing_and_misshapen_weights_are_named() -> None:
    """A tensor the weights lack, or one of another shape, is a TPCompileError naming it."""
    state = GPT(CFG).state_dict()
    del state["transformer.ln_f.bias"]
    with pytest.raises(tpcompile.TPCompileError, match="transformer.ln_f.bias"):
        _meta_ranks(2, state)
    state = GPT(GPTConfig(attention="manual", vocab_size=256)).state_dict()
    with pytest.raises(tpcompile.TPCompileError, match=r"'transformer.wte.weight' has shape \[256, 64\]"):
        _meta_ranks(2, state)
