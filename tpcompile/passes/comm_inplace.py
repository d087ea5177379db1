"""In-place reduction pass: an all-reduce whose input is a dead temporary sums into that input.

`all_reduce(x)` returns a new tensor, so every forward all-reduce costs an output buffer and a
copy of x. When nothing else can observe x, summing into x itself is equivalent. The pass
proves that from the rank graph alone, and only then emits `all_reduce.inplace`:

- x is computed by a call_function in the graph (not a placeholder, parameter, buffer or
  constant: those are read again by the caller or the next step);
- the all-reduce is x's only user (nothing reads x before or after the sum);
- x's producer returns a fresh tensor (its schema declares no alias: not a view of anything);
- x's producer does not save its own result for backward (`FRESH_UNSAVED`: ops whose
  derivative reads only their inputs; `tanh`, `exp`, `sigmoid`, `relu`... save the result
  and are refused).

Every all-reduce gets `node.meta['tp_inplace']`: True when it now sums in place, else the
reason it could not. Everything else stays functional.
"""
from __future__ import annotations

from typing import Union

import torch
from torch import fx
from torch.fx import GraphModule, Node

import tpcompile.ops.inplace  # noqa: F401  (registers torch.ops.tpcompile.all_reduce.inplace)

aten = torch.ops.aten
META_KEY = "tp_inplace"

# Ops returning a new tensor whose backward formula reads only their inputs, never the result.
FRESH_UNSAVED = frozenset({
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
    aten.matmul.default, aten.linear.default, aten.embedding.default,
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.neg.default,
    aten.masked_fill.Scalar, aten.masked_fill.Tensor,
    aten.sum.default, aten.sum.dim_IntList, aten.cat.default, aten.clone.default,
})


def dead_temporary(x: object, user: Node) -> Union[bool, str]:
    """True when `user` may overwrite x: else why not (a sentence naming x)."""
    if not isinstance(x, Node):
        return "its input is not a graph value"
    if x.op in ("placeholder", "get_attr"):
        kind = "a graph input" if x.op == "placeholder" else f"the parameter or buffer {x.target}"
        return f"its input {x.name} is {kind}"
    if x.op != "call_function":
        return f"its input {x.name} comes from a {x.op}"
    others = [u.name for u in x.users if u is not user]
    if others:
        return f"its input {x.name} is also read by {', '.join(others)}"
    schema = getattr(x.target, "_schema", None)
    if schema is None or any(r.alias_info is not None for r in schema.returns):
        return f"its input {x.name} may be a view ({getattr(x.target, '__name__', x.target)})"
    if x.target not in FRESH_UNSAVED:
        return f"its input {x.name} may be saved for backward by {x.target}"
    return True


def inplace_pass(gm: Union[GraphModule, fx.Graph]) -> Union[GraphModule, fx.Graph]:
    """Turn every all_reduce whose input is a dead temporary into all_reduce.inplace."""
    graph = gm.graph if isinstance(gm, GraphModule) else gm
    functional = torch.ops.tpcompile.all_reduce.default
    changed = False
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not functional:
            continue
        verdict = dead_temporary(node.args[0], node)
        node.meta[META_KEY] = verdict
        if verdict is True:
            node.target = torch.ops.tpcompile.all_reduce.inplace
            changed = True
    if changed and isinstance(gm, GraphModule):
        gm.recompile()
    return gm
