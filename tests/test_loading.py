"""Resolving MODEL strings: files, modules, bundled names and offline Hugging Face configs."""

from pathlib import Path

import pytest
import torch
from torch import nn

from tpcompile.models.spec import example_inputs_of, load_model
from tpcompile.errors import TPCompileError
from tpcompile.models import GPT, MLPStack

USER_FILE = '''
import torch
from torch import nn
from helper import WIDTH


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)

    def example_inputs(self) -> tuple:
        return (torch.ones(2, WIDTH),)


class NeedsArgs(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()


instance = Tiny()


def factory() -> nn.Module:
    return Tiny()


def not_a_model() -> int:
    return 3


number = 7
'''


@pytest.fixture
def user_file(tmp_path: Path) -> Path:
    """A model file that imports a sibling module."""
    (tmp_path / "helper.py").write_text("WIDTH = 6\n")
    path = tmp_path / "my_models.py"
    path.write_text(USER_FILE)
    return path


def test_bundled_name() -> None:
    """'gpt' resolves to the bundled GPT with its (2, 16) example ids and no kwargs."""
    model, args, kwargs = load_model("gpt")
    assert isinstance(model, GPT)
    assert len(args) == 1 and args[0].shape == (2, 16) and kwargs == {}


@pytest.mark.parametrize("name", ["Tiny", "instance", "factory"])
def test_file_spec_forms(user_file: Path, name: str) -> None:
    """file.py:NAME accepts a class, an instance and a factory, with the model's example inputs."""
    model, args, kwargs = load_model(f"{user_file}:{name}")
    assert type(model).__name__ == "Tiny"
    assert args[0].shape == (2, 6) and kwargs == {}
    assert model(*args).shape == (2, 6)


def test_file_instance_is_the_same_object(user_file: Path) -> None:
    """Loading a file twice reuses the module, so an instance keeps its identity."""
    first, _, _ = load_model(f"{user_file}:instance")
    second, _, _ = load_model(f"{user_file}:instance")
    assert first is second


def test_module_spec() -> None:
    """pkg.mod:NAME imports the module and constructs the class without arguments."""
    model, args, kwargs = load_model("tpcompile.models.mlp:MLPStack")
    assert isinstance(model, MLPStack)
    assert args[0].shape == (4, 64) and kwargs == {}


def test_module_without_example_inputs() -> None:
    """A module without example_inputs() gives empty args and kwargs."""
    model, args, kwargs = load_model("torch.nn:Identity")
    assert isinstance(model, nn.Identity) and args == () and kwargs == {}


@pytest.mark.parametrize(
    ("value", "expected_args", "expected_kwargs"),
    [
        (torch.ones(2), 1, {}),
        ({"x": torch.ones(2)}, 0, {"x"}),
        (((torch.ones(2),), {"y": torch.ones(1)}), 1, {"y"}),
        ([torch.ones(1), torch.ones(2)], 2, {}),
    ],
)
def test_example_input_forms(value: object, expected_args: int, expected_kwargs: object) -> None:
    """example_inputs() may return a tensor, a kwargs dict, an (args, kwargs) pair or a sequence."""
    model = nn.Identity()
    model.example_inputs = lambda: value  # type: ignore[attr-defined]
    args, kwargs = example_inputs_of(model)
    assert len(args) == expected_args and set(kwargs) == set(expected_kwargs)


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_hf_causal_lm_offline(model_type: str) -> None:
    """hf:<type> builds a small causal LM from its config class, in eval mode, with use_cache off."""
    model, args, kwargs = load_model(f"hf:{model_type}")
    config = model.config
    assert type(model).__name__.endswith(("LMHeadModel", "ForCausalLM"))
    assert not model.training
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (2, 64, 4)
    assert config.vocab_size == 128
    assert args == () and kwargs["use_cache"] is False and kwargs["input_ids"].shape == (2, 8)
    with torch.no_grad():
        logits = model(*args, **kwargs).logits
    assert logits.shape == (2, 8, 128)


def test_hf_small_intermediate_size() -> None:
    """The feed-forward width is 128 under each config's own name (n_inner for gpt2)."""
    gpt2, _, _ = load_model("hf:gpt2")
    llama, _, _ = load_model("hf:llama")
    assert gpt2.transformer.h[0].mlp.c_fc.nf == 128
    assert llama.model.layers[0].mlp.up_proj.out_features == 128


def test_hf_encoder_has_no_use_cache() -> None:
    """hf:bert builds the base encoder and passes only input_ids."""
    model, args, kwargs = load_model("hf:bert")
    assert type(model).__name__ == "BertModel"
    assert set(kwargs) == {"input_ids"}
    with torch.no_grad():
        assert model(**kwargs).last_hidden_state.shape == (2, 8, 64)


def test_hf_is_deterministic() -> None:
    """Two loads of the same hf spec have identical weights."""
    a, _, _ = load_model("hf:gpt2")
    b, _, _ = load_model("hf:gpt2")
    for va, vb in zip(a.state_dict().values(), b.state_dict().values()):
        assert torch.equal(va, vb)


BAD_SPECS = [
    "no-such-model",
    "missing_file.py:Model",
    "tpcompile.models.mlp:Nope",
    "no_such_package.mod:Model",
    "tpcompile.models.gpt:GPT",
    "math:pi",
    "hf:",
    "hf:definitely_not_a_model_type",
    ":Model",
]


@pytest.mark.parametrize("spec", BAD_SPECS)
def test_bad_specs_raise(spec: str) -> None:
    """Every unresolvable spec raises TPCompileError naming the spec."""
    with pytest.raises(TPCompileError) as info:
        load_model(spec)
    assert repr(spec) in str(info.value)
    assert isinstance(info.value, ValueError)


def test_unknown_spec_lists_accepted_forms() -> None:
    """An unrecognised spec's message lists the accepted forms."""
    with pytest.raises(TPCompileError, match=r"file\.py:NAME.*hf:<model_type>"):
        load_model("nothing")


@pytest.mark.parametrize(("name", "fragment"), [
    ("NeedsArgs", "no arguments"), ("not_a_model", "int"), ("number", "int"),
    ("absent", "my_models.py has no 'absent'; it defines: NeedsArgs, Tiny"),  # the file, not an internal module
])
def test_bad_file_names(user_file: Path, name: str, fragment: str) -> None:
    """Names in a file that are not usable models raise TPCompileError saying why."""
    with pytest.raises(TPCompileError, match=fragment):
        load_model(f"{user_file}:{name}")


def test_file_that_fails_to_run(tmp_path: Path) -> None:
    """A file that raises on import is reported as a TPCompileError with the original error."""
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(TPCompileError, match="boom"):
        load_model(f"{path}:Model")


def test_config_overrides_bundled_models() -> None:
    """--config replaces fields of a bundled GPT's config (the variant's own switches kept) or MLP arguments."""
    model, args, _ = load_model("gpt-manual", {"n_layer": 1, "n_embd": 32})
    assert isinstance(model, GPT) and len(model.transformer.h) == 1
    assert (model.config.n_embd, model.config.attention) == (32, "manual")
    assert model(*args).shape == (2, 16, 256)
    mlp, args, _ = load_model("mlp", {"dims": (8, 16, 8)})
    assert mlp.dims == (8, 16, 8) and args[0].shape == (4, 8)


def test_config_is_passed_to_classes_and_factories(user_file: Path) -> None:
    """file.py:Class with config calls the class with those keyword arguments; an instance refuses them."""
    model, _, _ = load_model(f"{user_file}:NeedsArgs", {"width": 3})
    assert type(model).__name__ == "NeedsArgs"
    with pytest.raises(TPCompileError, match="ready-made module instance"):
        load_model(f"{user_file}:instance", {"width": 3})


def test_hf_config_overrides() -> None:
    """hf: overrides land in the config; the example ids stay inside an overridden vocabulary."""
    model, _, kwargs = load_model("hf:llama", {"num_hidden_layers": 1, "vocab_size": 40})
    assert model.config.num_hidden_layers == 1 and model.config.vocab_size == 40
    assert int(kwargs["input_ids"].max()) < 40


@pytest.mark.parametrize(("spec", "config", "fragment"), [
    ("gpt", {"n_layers": 1}, "unknown --config key 'n_layers'"),
    ("gpt", {"n_head": 5}, "not divisible by n_head 5"),
    ("hf:gpt2", {"n_layr": 1}, "did you mean n_layer"),
])
def test_bad_config(spec: str, config: dict, fragment: str) -> None:
    """Unknown keys and invalid values are TPCompileErrors naming the key or the model's complaint."""
    with pytest.raises(TPCompileError, match=fragment):
        load_model(spec, config)


def test_hf_unknown_type_names_close_ones() -> None:
    """A misspelt model type suggests the nearest real ones instead of listing them all."""
    with pytest.raises(TPCompileError, match="did you mean llama") as info:
        load_model("hf:lama")
    assert len(str(info.value)) < 300
