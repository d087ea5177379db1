"""The Hugging Face architectures added to tests/hf_models.py (NEW_ARCHS) shard at world sizes 2 and 4: every
rank equals the original within 1e-4 on another batch and length, each rank holds at most 1.25 / world size of
the parameter bytes, and `shard` warns nothing (every split dim of these configs divides by 2 and 4).

One capture per architecture serves both world sizes. A few architectures, one for each idiom the compiler
needed for them, run in the default suite; the rest are marked slow (pytest -m slow).
"""
from __future__ import annotations

import warnings

import pytest
import torch

import tpcompile
from tpcompile.api import shard_captured
from tpcompile.capture import capture

pytest.importorskip("transformers")
from hf_models import NEW_ARCHS, Arch, build, held_share, inputs  # noqa: E402

HELD = 1.25
# falcon (multi-query heads cut from a viewed projection), albert (embedding projection, shared layer),
# deepseek_v3 (latent attention keys filled into a fresh tensor, experts)
FAST = ("falcon", "albert", "deepseek_v3")
GAPS = ("falcon_mamba",)  # docs/architectures.md, Known gaps
CHECKED = [a for a in NEW_ARCHS if a.name not in GAPS]


def _check(arch: Arch) -> None:
    model = build(arch)
    torch.manual_seed(1)
    cap = capture(model, example_kwargs=inputs(arch, 2, 8))
    torch.manual_seed(2)
    kw = inputs(arch, 3, 13)
    with torch.no_grad():
        ref = model(**kw)[arch.output]
    for ws in (2, 4):
        with warnings.catch_warnings():
            warnings.simplefilter("error", tpcompile.TPCompileWarning)
            sm = shard_captured(cap, ws)
        assert not sm.plan.warnings
        held = held_share(model, sm)
        assert held <= HELD / ws, f"{arch.name} at {ws} ranks: each rank holds {held:.1%} of the parameters"
        with torch.no_grad():
            outs = tpcompile.simulate(sm, **kw)
        for r, out in enumerate(outs):
            torch.testing.assert_close(out[arch.output], ref, atol=1e-4, rtol=0,
                                       msg=lambda m: f"{arch.name} at {ws} ranks, rank {r}: {m}")


@pytest.mark.parametrize("arch", [a for a in CHECKED if a.name in FAST], ids=lambda a: a.name)
def test_new_architecture_at_2_and_4_ranks(arch: Arch) -> None:
    """Equal within 1e-4, at most 1.25/ws of the parameter bytes per rank, no warning; at 2 and 4 ranks."""
    _check(arch)


@pytest.mark.slow
@pytest.mark.parametrize("arch", [a for a in CHECKED if a.name not in FAST], ids=lambda a: a.name)
def test_new_architecture_at_2_and_4_ranks_slow(arch: Arch) -> None:
    """The same for the other new architectures."""
    _check(arch)


@pytest.mark.slow
def test_falcon_mamba_runs_only_at_its_captured_length() -> None:
    """Falcon-Mamba's selective scan is a Python loop over the tokens, unrolled by torch.export: the graph runs
    at the captured length only, and a longer input is refused with the way out."""
    arch = next(a for a in NEW_ARCHS if a.name == "falcon_mamba")
    model = build(arch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, 2, example_kwargs=inputs(arch, 2, 8))
    with pytest.raises(tpcompile.TPCompileError, match="capture fixed that dim at 8"):
        tpcompile.simulate(sm, **inputs(arch, 3, 13))
    kw = inputs(arch, 3, 8)
    with torch.no_grad():
        ref = model(**kw).logits
        for out in tpcompile.simulate(sm, **kw):
            torch.testing.assert_close(out.logits, ref, atol=1e-4, rtol=0)
