"""The bundled example models: shapes, determinism, attention variants and export."""

import pytest
import torch
from torch import nn
from torch.export import Dim, export

from tpcompile.errors import TPCompileError
from tpcompile.models import GPT, MODEL_NAMES, GPTConfig, MLPStack, build


def test_mlp_default_shapes() -> None:
    """The default MLPStack has four Linear layers and maps (4, 64) to (4, 64)."""
    model = MLPStack()
    (x,) = model.example_inputs()
    assert x.shape == (4, 64)
    assert sum(isinstance(m, nn.Linear) for m in model.modules()) == 4
    assert model(x).shape == (4, 64)


def test_mlp_custom_dims_and_activation() -> None:
    """Custom dims give one Linear per step and the chosen activation between them only."""
    model = MLPStack(dims=(8, 16, 4), activation="relu")
    kinds = [type(m) for m in model.layers]
    assert kinds == [nn.Linear, nn.ReLU, nn.Linear]
    assert model(torch.randn(3, 8)).shape == (3, 4)


def test_mlp_rejects_unknown_activation() -> None:
    """An unknown activation name is a ValueError that lists the choices."""
    with pytest.raises(ValueError, match="gelu"):
        MLPStack(activation="swishy")


@pytest.mark.parametrize("name", ["gpt", "gpt-manual", "gpt-sep"])
def test_gpt_logits_shape(name: str) -> None:
    """Each GPT variant maps (2, 16) token ids to (2, 16, 256) finite logits."""
    model = build(name)
    (idx,) = model.example_inputs()
    assert idx.shape == (2, 16) and idx.dtype == torch.int64
    logits = model(idx)
    assert logits.shape == (2, 16, 256)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_build_is_deterministic(name: str) -> None:
    """Two builds of the same name have identical parameters and outputs, in eval mode."""
    a, b = build(name), build(name)
    assert not a.training
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    inputs = a.example_inputs()
    assert torch.equal(a(*inputs), b(*inputs))


def test_build_leaves_global_rng_alone() -> None:
    """Building a model does not reset the caller's random stream."""
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build("gpt")
    assert torch.equal(torch.rand(3), expected)


def test_build_unknown_name() -> None:
    """An unknown bundled name raises TPCompileError listing the bundled names."""
    with pytest.raises(TPCompileError, match="gpt-manual"):
        build("gpt-huge")


def test_weight_tying_and_projections() -> None:
    """'gpt' ties lm_head to wte and fuses qkv; 'gpt-sep' has separate q/k/v and an untied head."""
    tied, sep = build("gpt"), build("gpt-sep")
    assert tied.lm_head.weight is tied.transformer.wte.weight
    assert hasattr(tied.transformer.h[0].attn, "c_attn")
    assert sep.lm_head.weight is not sep.transformer.wte.weight
    attn = sep.transformer.h[0].attn
    assert all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj")) and not hasattr(attn, "c_attn")


def test_manual_attention_matches_sdpa() -> None:
    """Masked manual attention gives the same logits as scaled_dot_product_attention."""
    sdpa, manual = build("gpt"), build("gpt-manual")
    assert "transformer.h.0.attn.causal_mask" in dict(manual.named_buffers())
    (idx,) = sdpa.example_inputs()
    torch.testing.assert_close(manual(idx), sdpa(idx), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["gpt", "gpt-manual"])
def test_gpt_is_causal(name: str) -> None:
    """Changing the last token leaves the logits of every earlier position unchanged."""
    model = build(name)
    (idx,) = model.example_inputs()
    changed = idx.clone()
    changed[:, -1] = (changed[:, -1] + 1) % model.config.vocab_size
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :-1], b[:, :-1])
    assert not torch.allclose(a[:, -1], b[:, -1])


def test_gpt_rejects_too_long_sequence() -> None:
    """A sequence longer than block_size is a ValueError."""
    model = GPT(GPTConfig(block_size=8))
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_export_with_dynamic_dims(name: str) -> None:
    """torch.export with every input dim Dim.AUTO gives a graph that matches eager at new sizes."""
    model = build(name)
    inputs = model.example_inputs()
    dynamic = tuple({d: Dim.AUTO for d in range(t.dim())} for t in inputs)
    program = export(model, inputs, dynamic_shapes=dynamic, strict=False)
    if name == "mlp":
        other = (torch.randn(7, 64),)
    else:
        other = (torch.randint(0, 256, (3, 9)),)
    with torch.no_grad():
        torch.testing.assert_close(program.module()(*other), model(*other))
