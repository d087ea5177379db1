"""torch.export (non-strict) with every input dim dynamic: the captured graph, its inputs' names and guards."""
from __future__ import annotations

import inspect
import logging
import os
import traceback
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn
from torch.export import Dim
from torch.utils import _pytree as pytree

from tpcompile.capture.input_dtypes import check_input_dtypes, embedding_ids_checked
from tpcompile.capture.input_dims import fixed_dims, install_guards, warn_fixed
from tpcompile.capture.model_state import model_state_kept, value_checks_off
from tpcompile.capture.regions import inline_regions
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


def infer_example_inputs(model: nn.Module, caller: str = "tpcompile.shard") -> tuple[tuple, dict]:
    """Example inputs of a model given none: its own `example_inputs()`, Hugging Face `dummy_inputs`, else read
    off its first Linear / Embedding layer; `caller` is the function the error message tells the user to call."""
    from tpcompile.models.spec import example_inputs_of

    args, kwargs = example_inputs_of(model, type(model).__name__)
    if args or kwargs:
        return args, kwargs
    dummy = getattr(model, "dummy_inputs", None)
    if isinstance(dummy, dict) and dummy:
        kwargs = dict(dummy)
        config = getattr(model, "config", None)
        # the cache object a decoder (or an encoder-decoder) returns with use_cache is no output torch.export takes
        if config is not None and getattr(config, "use_cache", None) is not None:
            if "use_cache" in inspect.signature(model.forward).parameters:
                kwargs["use_cache"] = False
        return (), kwargs
    how = f"pass example_inputs=(tensor, ...) or example_kwargs={{...}} to {caller}, or give the model an " \
          f"example_inputs() method"
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Embedding):
            return (torch.randint(0, mod.num_embeddings, (2, 8)),), {}
        if isinstance(mod, nn.Linear):
            return (torch.randn(2, mod.in_features),), {}
        own = [n for n, _ in mod.named_parameters(recurse=False)]
        if own:
            where = (f"its first layer {name} is a {type(mod).__name__}" if name else
                     f"it holds the parameter{'s' * (len(own) > 1)} {', '.join(own[:3])} itself")
            raise TPCompileError(f"cannot infer example inputs for {type(model).__name__}: {where}, before any "
                                 f"Linear or Embedding; {how}")
    raise TPCompileError(f"cannot infer example inputs for {type(model).__name__}: it has no layers; {how}")


def user_frame(exc: BaseException) -> str:
    """'at models.py:36 in forward: n = int(x.sum())': the innermost line of the model's own code in exc's
    traceback (not torch's or tpcompile's), or '' when there is none."""
    skip = [os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__))]
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if os.path.isfile(f.filename) and not any(f.filename.startswith(d + os.sep) for d in skip)]
    if not frames:
        return ""
    f = frames[-1]
    path = os.path.relpath(f.filename) if f.filename.startswith(os.getcwd() + os.sep) else f.filename
    return f"at {path}:{f.lineno} in {f.name}" + (f": {f.line.strip()}" if f.line else "")


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
        with model_state_kept(model), explicit_signature(model, args, kwargs), \
                embedding_ids_checked(model, args, kwargs), value_checks_off():
            if dynamic_shapes is None:
                shapes = auto_dynamic_shapes(model, args, kwargs)  # by the explicit signature's names
            ep = torch.export.export(model, args, kwargs, dynamic_shapes=shapes, strict=False)
    except TPCompileError:
        raise
    except Exception as e:  # torch.export raises many types; all mean the same to the user
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        where = user_frame(e)
        raise TPCompileError(
            f"torch.export could not capture {name}: {type(e).__name__}: {first}{f' ({where})' if where else ''}\n"
            f"  try: example inputs that take the model's usual path; dynamic_shapes=... to fix a "
            f"dimension that cannot vary (e.g. dynamic_shapes={{'x': None}}); torch.cond for "
            f"data-dependent Python control flow") from e
    gm = inline_regions(ep.module(), autocast_state())  # grad-mode and no-op autocast regions inlined
    if not torch.is_autocast_enabled():  # under autocast the captured ops cast their inputs themselves
        check_input_dtypes(gm, model, args, kwargs)  # before the fixed-dim warnings an integer input would cause
    fixed = fixed_dims(gm, args, kwargs)
    warn_fixed(fixed, args, kwargs, model)
    install_guards(gm, fixed, autocast_state())
    return Captured(gm=gm, model_name=name, example_args=args, example_kwargs=kwargs,
                    module_paths={n for n, _ in model.named_modules() if n}, fixed_dims=fixed,
                    autocast=autocast_state())
