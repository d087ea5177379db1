"""Turn a MODEL string from the command line into a module and its example inputs."""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.util
import os
import sys
import zlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tpcompile.errors import TPCompileError
from tpcompile.models import MODEL_NAMES, build

ACCEPTED_FORMS = (
    "file.py:NAME, pkg.mod:NAME (NAME an nn.Module instance, or an nn.Module subclass or factory, called with "
    f"the --config arguments), a bundled model ({', '.join(MODEL_NAMES)}) or hf:<model_type> (e.g. hf:gpt2, hf:llama)"
)

# Small sizes for Hugging Face configs, under the generic names every config understands.
HF_SIZES: dict[str, int] = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "vocab_size": 128,
    "max_position_embeddings": 64,
}

# Model-specific names for the same sizes; only the ones a config already has are passed.
HF_ALIASES: dict[str, int] = {
    "n_inner": 128,
    "ffn_dim": 128,
    "d_ff": 128,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "num_key_value_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_attention_heads": 4,
    "decoder_layers": 2,
    "num_decoder_layers": 2,
    "head_dim": 16,
    "d_kv": 16,
}

HF_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
HF_BATCH, HF_SEQ = 2, 8


def load_model(spec: str, config: dict[str, Any] | None = None) -> tuple[nn.Module, tuple, dict]:
    """Resolve `spec` to (module, example args, example kwargs); `config` overrides sizes and switches."""
    spec = spec.strip()
    config = dict(config or {})
    if spec.startswith("hf:"):
        return _load_hf(spec, spec[3:], config)
    if spec in MODEL_NAMES:
        model = _rebuilt(spec, build(spec), config) if config else build(spec)
        return (model, *example_inputs_of(model, spec))
    if ":" not in spec:
        raise TPCompileError(f"cannot resolve model {spec!r}; accepted forms: {ACCEPTED_FORMS}")
    source, name = spec.rsplit(":", 1)
    if not source or not name:
        raise TPCompileError(f"cannot resolve model {spec!r}; accepted forms: {ACCEPTED_FORMS}")
    is_file = source.endswith(".py")
    module = _import_file(spec, Path(source)) if is_file else _import_module(spec, source)
    model = _instantiate(spec, _getattr_path(spec, module, name, Path(source).name if is_file else source), config)
    return (model, *example_inputs_of(model, spec))


def _rebuilt(spec: str, model: nn.Module, config: dict[str, Any]) -> nn.Module:
    """A bundled model built again with some of its config fields (GPT) or arguments (MLP) replaced."""
    base = getattr(model, "config", None)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # the same seed build() uses, so only the overrides differ
            if dataclasses.is_dataclass(base):
                fields = {f.name for f in dataclasses.fields(base)}
                _check_keys(spec, config, fields)
                return type(model)(dataclasses.replace(base, **config)).eval()
            return type(model)(**config).eval()
    except TPCompileError:
        raise
    except TypeError as exc:
        raise TPCompileError(f"{spec}: --config {_pairs(config)} does not fit {type(model).__name__}: {exc}") from exc
    except ValueError as exc:
        raise TPCompileError(f"{spec}: --config {_pairs(config)} gives an invalid model: {exc}") from exc


def _check_keys(spec: str, config: dict[str, Any], known: set[str]) -> None:
    """Every override names a known field, or a TPCompileError listing the fields."""
    unknown = sorted(set(config) - known)
    if unknown:
        raise TPCompileError(f"{spec}: unknown --config key {unknown[0]!r}; known keys are {', '.join(sorted(known))}")


def _pairs(config: dict[str, Any]) -> str:
    """The overrides as the key=value words they were given as."""
    return " ".join(f"{k}={v}" for k, v in config.items())


def example_inputs_of(model: nn.Module, spec: str = "model") -> tuple[tuple, dict]:
    """The model's own `example_inputs()` as (args, kwargs), or empty when it has none."""
    provider = getattr(model, "example_inputs", None)
    if provider is None:
        return (), {}
    try:
        value = provider() if callable(provider) else provider
    except Exception as exc:
        raise TPCompileError(f"{spec}: example_inputs() failed: {type(exc).__name__}: {exc}") from exc
    if isinstance(value, torch.Tensor):
        return (value,), {}
    if isinstance(value, dict):
        return (), dict(value)
    if isinstance(value, (tuple, list)):
        if len(value) == 2 and isinstance(value[0], (tuple, list)) and isinstance(value[1], dict):
            return tuple(value[0]), dict(value[1])
        return tuple(value), {}
    raise TPCompileError(
        f"{spec}: example_inputs() returned {type(value).__name__}; expected a tensor, a tuple of "
        "arguments, a dict of keyword arguments or an (args, kwargs) pair"
    )


def _import_file(spec: str, path: Path) -> Any:
    """Execute a Python file as a fresh module."""
    if not path.is_file():
        raise TPCompileError(f"cannot resolve model {spec!r}: file {str(path)!r} does not exist")
    path = path.resolve()
    mod_name = f"_tpcompile_user_{path.stem}_{zlib.crc32(str(path).encode()):08x}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    file_spec = importlib.util.spec_from_file_location(mod_name, path)
    if file_spec is None or file_spec.loader is None:
        raise TPCompileError(f"cannot resolve model {spec!r}: {str(path)!r} is not importable Python")
    module = importlib.util.module_from_spec(file_spec)
    # Registered before execution so dataclasses and pickling inside the file can find it.
    sys.modules[mod_name] = module
    # The file's own folder goes on the path while it runs so its sibling imports work.
    sys.path.insert(0, str(path.parent))
    try:
        file_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[mod_name]
        raise TPCompileError(f"cannot resolve model {spec!r}: running {path.name} failed: "
                             f"{type(exc).__name__}: {exc}") from exc
    finally:
        sys.path.remove(str(path.parent))
    return module


def _import_module(spec: str, dotted: str) -> Any:
    """Import a module by its dotted name."""
    # The console script, unlike `python -m`, does not put the working directory on the path.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        return importlib.import_module(dotted)
    except Exception as exc:
        raise TPCompileError(f"cannot resolve model {spec!r}: importing {dotted!r} failed: "
                             f"{type(exc).__name__}: {exc}; accepted forms: {ACCEPTED_FORMS}") from exc


def _getattr_path(spec: str, module: Any, name: str, where: str) -> Any:
    """Follow a possibly dotted attribute name from a module (`where`: the file or module as the user named it)."""
    obj = module
    for part in name.split("."):
        if not hasattr(obj, part):
            owner = where if obj is module else f"{where}:{name.rpartition(part)[0].rstrip('.')}"
            raise TPCompileError(f"cannot resolve model {spec!r}: {owner} has no {part!r}; "
                                 f"{_candidates(obj, part)}")
        obj = getattr(obj, part)
    return obj


def _candidates(obj: Any, missing: str) -> str:
    """What could be meant: the models, classes and functions `obj` defines itself, nearest first."""
    home = getattr(obj, "__name__", None)
    names = sorted(n for n, v in vars(obj).items() if not n.startswith("_") and (
        isinstance(v, nn.Module) or (callable(v) and getattr(v, "__module__", None) == home)))
    if not names:
        return "it defines no nn.Module, class or function"
    close = difflib.get_close_matches(missing, names, n=3)
    listed = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
    return (f"did you mean {', '.join(close)}? " if close else "") + f"it defines: {listed}"


def _instantiate(spec: str, obj: Any, config: dict[str, Any] | None = None) -> nn.Module:
    """Accept a module instance, a module class or a factory (called with the --config overrides)."""
    config = config or {}
    if isinstance(obj, nn.Module):
        if config:
            raise TPCompileError(f"cannot apply --config {_pairs(config)} to {spec!r}: it names a ready-made "
                                 "module instance; name its class or a factory instead")
        return obj
    if not callable(obj):
        raise TPCompileError(f"cannot resolve model {spec!r}: it names a {type(obj).__name__}, "
                             "not an nn.Module instance, subclass or factory")
    kind = "class" if isinstance(obj, type) else "factory"
    try:
        model = obj(**config)
    except Exception as exc:
        given = f"with {_pairs(config)}" if config else "with no arguments"
        raise TPCompileError(f"cannot resolve model {spec!r}: calling {kind} {getattr(obj, '__name__', obj)} "
                             f"{given} failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise TPCompileError(f"cannot resolve model {spec!r}: the {kind} returned a "
                             f"{type(model).__name__}, not an nn.Module")
    return model


def _hf_config(spec: str, model_type: str, overrides: dict[str, Any]) -> Any:
    """A small config for `model_type`, with every size alias the config knows set small, then the overrides."""
    from transformers import AutoConfig

    try:
        default = AutoConfig.for_model(model_type)
    except Exception as exc:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

        # transformers' own message lists every model type there is: name the nearest few instead
        close = difflib.get_close_matches(model_type, sorted(CONFIG_MAPPING_NAMES), n=4)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise TPCompileError(f"cannot resolve model {spec!r}: transformers has no model type "
                             f"{model_type!r}{hint}") from exc
    kwargs: dict[str, Any] = dict(HF_SIZES)
    kwargs.update({k: v for k, v in HF_ALIASES.items() if k in default.to_dict()})
    unknown = [k for k in overrides if not hasattr(default, k)]
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(default.to_dict()), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise TPCompileError(f"{spec}: the {model_type} config has no key {unknown[0]!r} (from --config){hint}")
    kwargs.update(overrides)
    for key in HF_TOKEN_IDS:
        token = overrides.get(key, getattr(default, key, None))
        if key not in overrides and isinstance(token, int) and token >= kwargs["vocab_size"]:
            kwargs[key] = kwargs["vocab_size"] - 1
    try:
        return AutoConfig.for_model(model_type, **kwargs)
    except Exception as exc:
        raise TPCompileError(f"cannot resolve model {spec!r}: building a small {model_type} config failed: "
                             f"{type(exc).__name__}: {exc}") from exc


def _is_encoder(config: Any) -> bool:
    """Encoder-only families (bert, roberta, ...) are masked-LM models without a decoder."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    return config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not config.is_encoder_decoder


def _load_hf(spec: str, model_type: str, overrides: dict[str, Any]) -> tuple[nn.Module, tuple, dict]:
    """Build a small, randomly initialised transformers model offline from its config class."""
    if not model_type:
        raise TPCompileError(f"cannot resolve model {spec!r}: hf: needs a model type, e.g. hf:gpt2")
    try:
        import transformers
    except ImportError as exc:
        raise TPCompileError(f"cannot resolve model {spec!r}: the transformers package is not installed "
                             "(pip install transformers)") from exc
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = _hf_config(spec, model_type, overrides)
    encoder = _is_encoder(config)
    causal = not encoder and config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    auto = transformers.AutoModelForCausalLM if causal else transformers.AutoModel
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = auto.from_config(config)
    except Exception as exc:
        raise TPCompileError(f"cannot resolve model {spec!r}: building {auto.__name__} for {model_type} "
                             f"failed: {type(exc).__name__}: {exc}") from exc
    model.eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (HF_BATCH, HF_SEQ), generator=gen, dtype=torch.long)
    kwargs: dict[str, Any] = {"input_ids": ids}
    if not encoder:
        kwargs["use_cache"] = False
    if config.is_encoder_decoder and not causal:
        kwargs["decoder_input_ids"] = ids.clone()
    return model, (), kwargs
