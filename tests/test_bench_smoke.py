"""The hand-written tensor-parallel GPT used by bench/compare.py equals the unsharded model."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tpcompile.models import GPT, GPTConfig
from tpcompile.runtime import launch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from handwritten_tp import TPGPT  # noqa: E402

pytestmark = pytest.mark.gloo

TINY = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)


def _tiny(**kw: object) -> GPT:
    """The tiny GPT with fixed weights."""
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**TINY, **kw})).eval()


VARIANTS = {"fused-tied": {}, "separate-untied-manual": dict(fused_qkv=False, tie_weights=False, attention="manual")}


def _hand_rank(rank: int, cases: dict, idx: torch.Tensor) -> dict:
    """Per variant: this rank's hand-written TP logits, collective counts and parameter bytes."""
    out = {}
    for name, (cfg, state) in cases.items():
        model = GPT(GPTConfig(**cfg)).eval()
        model.load_state_dict(state)
        tp = TPGPT(model, rank, 2)
        out[name] = (tp(idx), tp.comm.counts(), tp.parameter_bytes())
    return out


def test_handwritten_tp_equals_unsharded() -> None:
    """At world size 2 on gloo, both ranks' logits equal the unsharded model's within 1e-5."""
    idx = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    models = {name: _tiny(**kw) for name, kw in VARIANTS.items()}
    cases = {name: ({**TINY, **VARIANTS[name]}, m.state_dict()) for name, m in models.items()}
    results = launch(2, _hand_rank, cases, idx, timeout=60)
    for name, model in models.items():
        with torch.no_grad():
            ref = model(idx)
        full = sum(p.numel() * p.element_size() for p in model.parameters())
        for rank, per_variant in enumerate(results):
            out, counts, nbytes = per_variant[name]
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=0, msg=lambda m: f"{name} rank {rank}: {m}")
            assert counts == {"all_reduce": 1 + 2 * TINY["n_layer"], "all_gather": 1}
            assert nbytes < full
