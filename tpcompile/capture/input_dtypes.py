"""Input dtypes checked against the model's first use of each input: float features where a matmul,
convolution or norm combines the input with a weight, integer ids where an embedding looks it up.

torch.export's fake tensors let a Linear take int64 values (the graph is captured, and fails only
when it runs) and stop at an Embedding given floats with torch's own message; both become one
`InputDtypeError` naming the input, the layer and the dtype to pass.
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from tpcompile.errors import TPCompileError
from tpcompile.passes.pass_context import module_path

aten = torch.ops.aten
# ops that need their input in the weight's dtype (no type promotion), so an integer input fails there
_SAME_DTYPE = {
    aten.linear.default, aten.mm.default, aten.addmm.default, aten.matmul.default, aten.bmm.default,
    aten.baddbmm.default, aten.mv.default, aten.conv1d.default, aten.conv2d.default, aten.conv3d.default,
    aten.convolution.default, aten.conv_transpose1d.default, aten.conv_transpose2d.input,
    aten.layer_norm.default, aten.native_layer_norm.default, aten.group_norm.default, aten.rms_norm.default,
}


class InputDtypeError(TPCompileError):
    """An input of a dtype its first use cannot take: `position` (among the positional inputs, else None),
    `shape` and the dtype `wanted` let a caller say what to pass in its own terms."""

    def __init__(self, what: str, advice: str, *, position: Optional[int], shape: tuple[int, ...],
                 wanted: torch.dtype) -> None:
        super().__init__(f"{what}; {advice}")
        self.what, self.position, self.shape, self.wanted = what, position, shape, wanted


def _name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32."""
    return str(dtype).removeprefix("torch.")


def _inputs(model: nn.Module, args: tuple, kwargs: dict) -> list[tuple[str, Optional[int], Any]]:
    """(name, positional index or None, value) of every flattened input, in the order of the graph's placeholders."""
    try:
        names = list(inspect.signature(model.forward).bind(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        names = []
    out = []
    for i, a in enumerate(args):
        for leaf in pytree.tree_leaves(a):
            out.append((names[i] if i < len(names) else f"input {i + 1}", i, leaf))
    for k, v in kwargs.items():
        for leaf in pytree.tree_leaves(v):
            out.append((k, None, leaf))
    return out


def _example(shape: tuple[int, ...], dtype: torch.dtype, high: int = 0) -> str:
    """The Python that makes such a tensor: torch.randn(2, 64) or torch.randint(0, 256, (2, 16))."""
    dims = ", ".join(map(str, shape))
    if dtype.is_floating_point:
        return f"torch.randn({dims})" + ("" if dtype == torch.float32 else f".to(torch.{_name(dtype)})")
    return f"torch.randint(0, {high or 2}, ({dims}{',' if len(shape) == 1 else ''}))"


def _value_dtype(gm: fx.GraphModule, node: fx.Node) -> Optional[torch.dtype]:
    """The dtype of a node's value: its fake value's, or the attribute's for a get_attr."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.dtype
    if node.op == "get_attr":
        obj = gm
        for part in str(node.target).split("."):
            obj = getattr(obj, part, None)
        return obj.dtype if isinstance(obj, torch.Tensor) else None
    return None


def check_input_dtypes(gm: fx.GraphModule, model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Raise InputDtypeError when an integer input reaches an op that needs the weight's floating dtype."""
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inputs = _inputs(model, args, kwargs)
    by_name = {item[0]: item for item in inputs}
    by_order = dict(zip(holders, inputs)) if len(inputs) == len(holders) else {}
    source: dict[fx.Node, fx.Node] = {n: n for n in holders}  # node -> the input placeholder it derives from
    weights: set[fx.Node] = {n for n in gm.graph.nodes if n.op == "get_attr"}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        reads = [a for a in node.all_input_nodes if a in source]
        if not reads:
            continue
        if node.target in _SAME_DTYPE:
            weight = next((a for a in node.all_input_nodes if a in weights), None)
            holder = source[reads[0]]  # named by forward's parameter, else matched by position
            item = by_name.get(str(holder.target)) or by_order.get(holder) or (str(holder.target), None, None)
            _check(gm, node, weight, reads[0], item, model)
        else:
            source[node] = source[reads[0]]
        if any(a in weights for a in node.all_input_nodes):
            weights.add(node)  # a weight cast or reshaped is still the weight


def _check(gm: fx.GraphModule, node: fx.Node, weight: Optional[fx.Node], read: fx.Node,
           item: tuple[str, Optional[int], Any], model: nn.Module) -> None:
    """The mismatch at one op that combines an input with a weight, as an InputDtypeError."""
    if weight is None:
        return
    want, got = _value_dtype(gm, weight), _value_dtype(gm, read)
    # a float input of another precision is left alone: mixed precision captures float32 inputs on purpose
    if want is None or got is None or not want.is_floating_point or got.is_floating_point or got.is_complex:
        return
    name, position, value = item
    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else ()
    layer = module_path(node)
    op = str(node.target).split(".")[-2] if "." in str(node.target) else str(node.target)
    raise InputDtypeError(
        f"{type(model).__name__} takes {_name(want)} values in input {name!r}, which is {_name(got)}: its first "
        f"use, {op}{f' at {layer}' if layer else ''}, combines it with a {_name(want)} weight",
        f"pass a {_name(want)} tensor, e.g. {_example(shape, want)}", position=position, shape=shape, wanted=want)


@contextmanager
def embedding_ids_checked(model: nn.Module, args: tuple, kwargs: dict) -> Iterator[None]:
    """While the block runs, an nn.Embedding of `model` given floating-point ids raises InputDtypeError."""
    floats = [(n, p, v) for n, p, v in _inputs(model, args, kwargs)
              if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())]
    if not floats:
        yield
        return

    def hook(path: str, mod: nn.Embedding) -> Any:
        """A forward pre-hook for the embedding at `path`."""
        def check(_mod: nn.Module, hook_args: tuple) -> None:
            """Raise InputDtypeError when the embedding is given floating-point ids."""
            ids = hook_args[0] if hook_args else None
            if not isinstance(ids, torch.Tensor) or not ids.is_floating_point():
                return
            name, position, value = floats[0]
            shape = tuple(value.shape)
            which = (f"input {name!r}, which is {_name(value.dtype)}" if len(floats) == 1 else
                     f"one of its floating-point inputs {', '.join(repr(f[0]) for f in floats)}")
            raise InputDtypeError(
                f"{type(model).__name__} takes integer token ids in {which}: "
                f"the embedding {path} ({mod.num_embeddings} rows) looks its values up",
                f"pass ids 0..{mod.num_embeddings - 1} as torch.long, e.g. "
                f"{_example(shape, torch.long, mod.num_embeddings)}",
                position=position if len(floats) == 1 else None, shape=shape, wanted=torch.long)
        return check

    handles = [m.register_forward_pre_hook(hook(p or type(model).__name__, m))
               for p, m in model.named_modules() if isinstance(m, nn.Embedding)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
