"""One capture for another input shape: its guards alone, its shape key, its weights shared with the first capture.

runtime/shape_cache.py keeps these captures per shape; this module holds what each one needs: the
captured graph's input guards as a module of their own (to ask whether a capture takes a call
without running it), the call's shapes by input name, the first capture's parameters and buffers
put into a new rank graph, and the check that the new plan splits every parameter as the first did.
"""
from __future__ import annotations

import copy
import inspect
import os
from typing import Any, Optional

import torch
from torch import fx, nn
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

from tpcompile.errors import TPCompileError

__all__ = ["describe_key", "device_of", "finding", "guard_module", "model_tensor_names", "on_device", "shape_key",
           "share_tensors", "split_difference", "user_stacklevel"]

GUARD_MODULES = ("_tpcompile_input_guard", "_guards_fn")  # capture/input_dims.install_guards, torch.export's


def guard_module(gm: GraphModule) -> Optional[GraphModule]:
    """The captured graph's input guards alone, called like it (None when it has none)."""
    graph, env = fx.Graph(), {}
    root = nn.Module()
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            env[n] = graph.node_copy(n)
        elif n.op == "call_module" and n.target in GUARD_MODULES:
            graph.node_copy(n, lambda a: env[a])
            root.add_module(n.target, getattr(gm, n.target))
    if not list(root.children()):
        return None
    graph.output(None)
    codegen = copy.copy(gm.graph._codegen)
    if hasattr(codegen, "pytree_info"):  # the model's calling convention in, nothing out
        codegen.pytree_info = codegen.pytree_info._replace(out_spec=None)
    graph._codegen = codegen
    out = GraphModule(root, graph, class_name="InputGuards")
    for attr in ("_in_spec",):
        if hasattr(gm, attr):
            setattr(out, attr, getattr(gm, attr))
    return out


def model_tensor_names(model: nn.Module) -> set[str]:
    """Every parameter and buffer name of the model (tied ones under each name)."""
    held = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    return {name for name, _ in held}


def share_tensors(gm: GraphModule, like: nn.Module, names: set[str]) -> GraphModule:
    """gm holding `like`'s parameters and buffers (the same objects) under each of `names`; gm itself.

    Tensors of gm outside `names` (constants the capture lifted, as a bias table built for the length) stay its own.
    """
    theirs = dict(like.named_parameters(remove_duplicate=False)) | dict(like.named_buffers(remove_duplicate=False))
    for kind, held in (("_parameters", gm.named_parameters(remove_duplicate=False)),
                       ("_buffers", gm.named_buffers(remove_duplicate=False))):
        for name, t in list(held):
            if name not in names:
                continue
            other = theirs.get(name)
            if other is None or other.shape != t.shape or other.dtype != t.dtype:
                seen = "none" if other is None else f"{tuple(other.shape)} {other.dtype}"
                raise TPCompileError(
                    f"the capture for a new input shape holds {name} as {tuple(t.shape)} {t.dtype} where the first "
                    f"capture's rank graph holds {seen}, so the two cannot share weights; shard with example inputs "
                    f"of the shape you run with, or pin the split with plan=")
            prefix, _, leaf = name.rpartition(".")
            getattr(gm.get_submodule(prefix) if prefix else gm, kind)[leaf] = other
    return gm


def shape_key(model: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """((input name, shape), ...) of the call's tensors, named by the model's forward where it binds."""
    try:
        named = list(inspect.signature(model.forward).bind(*args, **kwargs).arguments.items())
    except TypeError:
        named = [(f"#{i}", a) for i, a in enumerate(args)] + list(kwargs.items())
    out = []
    for name, value in named:
        leaves = [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]
        out += [(name if len(leaves) == 1 else f"{name}[{i}]", tuple(int(s) for s in t.shape))
                for i, t in enumerate(leaves)]
    return tuple(out)


def describe_key(key: tuple) -> str:
    """"input 'ids' 3x9, input 'mask' 3x9"."""
    return ", ".join(f"input {name!r} {'x'.join(map(str, shape)) or 'scalar'}" for name, shape in key) or "no tensors"


def finding(error: Exception) -> str:
    """What a guard found, without its way out (the words before its first '; ')."""
    return str(error).split("; ")[0]


def user_stacklevel() -> int:
    """The stacklevel of the first caller outside tpcompile and torch (the user's line)."""
    skip = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(torch.__file__))
    frame, level = inspect.currentframe(), 1
    while frame is not None and frame.f_back is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    return level - 1


def split_difference(first: Any, other: Any) -> Optional[str]:
    """'<param> as <split> (first capture: <split>)' for the first parameter split otherwise, else None."""
    def split(p: Any) -> str:
        return f"{p.role} dim={p.dim} {p.global_shape}->{p.local_shape}"
    for name, p in first.parameters.items():
        q = other.parameters.get(name)
        if q is None or (p.slice(), p.local_shape) != (q.slice(), q.local_shape):
            return f"{name} as {'nothing' if q is None else split(q)} (first capture: {split(p)})"
    return None


def whole_parameters(plan: Any) -> frozenset:
    """The names of the parameters a plan keeps whole, tied names included. A capture at another shape keeps them
    whole from the start: a dim the model's code fixes can change which conflicts a split meets (a conflict at
    one length and not at another), and the rank graphs of every capture share one set of weights."""
    return frozenset(n for p in plan.parameters.values() if p.slice() is None for n in (p.name, *p.tied))


def device_of(model: nn.Module) -> Optional[torch.device]:
    """The device of the model's first parameter or buffer (None for a model without any)."""
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return None


def on_device(value: Any, device: Optional[torch.device]) -> Any:
    """value with its tensors on the model's device (meta for a meta model), so that it captures there."""
    if device is None:
        return value
    return pytree.tree_map(
        lambda v: v.to(device) if isinstance(v, torch.Tensor) and v.device != device else v, value)
