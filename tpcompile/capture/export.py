"""torch.export (non-strict) with every input dim dynamic: the captured graph, its inputs' names and guards."""
from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn
from torch.export import Dim
from torch.utils import _pytree as pytree

from tpcompile.capture.input_dims import fixed_dims, install_guards, warn_fixed
from tpcompile.capture.model_state import model_state_kept
from tpcompile.capture.signature import explicit_signature
from tpcompile.errors import TPCompileError
from tpcompile.ops.guards import autocast_state

log = logging.getLogger("tpcompile")


@dataclass
class Captured:
    """The unsharded graph and what the later passes need to know about its inputs."""

    gm: torch.fx.GraphModule
    model_name: str
    example_args: tuple
    example_kwargs: dict
    module_paths: set[str] = field(default_factory=set)
    fixed_dims: tuple = ()  # FixedDim per input dim the capture fixed (ops/guards.py)
    autocast: tuple = ()  # the autocast state captured under (ops/guards.autocast_state)


def infer_example_inputs(model: nn.Module) -> tuple[tuple, dict]:
    """Example inputs from Hugging Face `dummy_inputs` or the first Linear / Embedding layer."""
    dummy = getattr(model, "dummy_inputs", None)
    if isinstance(dummy, dict) and dummy:
        kwargs = dict(dummy)
        config = getattr(model, "config", None)
        if config is not None and getattr(config, "use_cache", None) is not None and not getattr(config, "is_encoder_decoder", False):
            if "use_cache" in inspect.signature(model.forward).parameters:
                kwargs["use_cache"] = False
        return (), kwargs
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Embedding):
            return (torch.randint(0, mod.num_embeddings, (2, 8)),), {}
        if isinstance(mod, nn.Linear):
            return (torch.randn(2, mod.in_features),), {}
        if list(mod.parameters(recurse=False)):
            where = name or "the model"
            raise TPCompileError(
                f"cannot infer example inputs for {type(model).__name__}: its first layer {where} is a "
                f"{type(mod).__name__}, not a Linear or Embedding; pass example_inputs=(tensor, ...) "
                f"or example_kwargs={{...}} to tpcompile.shard")
    raise TPCompileError(f"cannot infer example inputs for {type(model).__name__}: it has no layers; "
                         f"pass example_inputs=(tensor, ...) to tpcompile.shard")


def auto_dynamic_shapes(model: nn.Module, args: tuple, kwargs: dict) -> Any:
    """Every dim of every tensor input marked Dim.AUTO, keyed by forward's parameter names."""
    def spec(v: Any) -> Any:
        return pytree.tree_map(lambda t: {d: Dim.AUTO for d in range(t.dim())} if isinstance(t, torch.Tensor) else None, v)

    sig = inspect.signature(model.forward)
    bound = sig.bind(*args, **kwargs)
    shapes = {}
    for name, value in bound.arguments.items():
        kind = sig.parameters[name].kind
        if kind == inspect.Parameter.VAR_POSITIONAL:
            shapes[name] = tuple(spec(v) for v in value)
        elif kind == inspect.Parameter.VAR_KEYWORD:
            shapes[name] = {k: spec(v) for k, v in value.items()}
        else:
            shapes[name] = spec(value)
    return shapes


def capture(model: nn.Module, example_inputs: tuple = (), example_kwargs: Optional[dict] = None,
            dynamic_shapes: Any = None) -> Captured:
    """Export the model to an aten-level fx graph whose inputs accept any batch and length."""
    if not isinstance(model, nn.Module):
        if isinstance(model, type) and issubclass(model, nn.Module):
            raise TPCompileError(f"tpcompile.shard got the class {model.__name__}, not a model; pass an instance, "
                                 f"e.g. tpcompile.shard({model.__name__}(...), world_size)")
        raise TPCompileError(f"tpcompile.shard expects a torch.nn.Module, got {type(model).__name__}; wrap the "
                             f"computation in an nn.Module whose forward takes tensors")
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    kwargs = dict(example_kwargs or {})
    if not args and not kwargs:
        args, kwargs = infer_example_inputs(model)
    name = type(model).__name__
    try:
        shapes = auto_dynamic_shapes(model, args, kwargs) if dynamic_shapes is None else dynamic_shapes
    except TypeError as e:
        raise TPCompileError(f"example inputs do not match {name}.forward{inspect.signature(model.forward)}: {e}; "
                             f"pass example_inputs=(...) and example_kwargs={{...}} that forward accepts") from e
    log.info("capturing %s with torch.export", name)
    try:
        with model_state_kept(model), explicit_signature(model, args, kwargs):
            if dynamic_shapes is None:
                shapes = auto_dynamic_shapes(model, args, kwargs)  # by the explicit signature's names
            ep = torch.export.export(model, args, kwargs, dynamic_shapes=shapes, strict=False)
    except TPCompileError:
        raise
    except Exception as e:  # torch.export raises many types; all mean the same to the user
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TPCompileError(
            f"torch.export could not capture {name}: {type(e).__name__}: {first}\n"
            f"  try: example inputs that take the model's usual path; dynamic_shapes=... to fix a "
            f"dimension that cannot vary (e.g. dynamic_shapes={{'x': None}}); torch.cond for "
            f"data-dependent Python control flow") from e
    gm = ep.module()
    fixed = fixed_dims(gm, args, kwargs)
    warn_fixed(fixed, args, kwargs, model)
    install_guards(gm, fixed, autocast_state())
    return Captured(gm=gm, model_name=name, example_args=args, example_kwargs=kwargs,
                    module_paths={n for n, _ in model.named_modules() if n}, fixed_dims=fixed,
                    autocast=autocast_state())
