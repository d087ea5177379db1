"""Input sizes a view proves equal: recorded in the capture's shape environment before any rule reads a shape.

torch.export gives every input dim its own symbol. Cross-attention reads two inputs whose batch
sizes must agree (`nn.MultiheadAttention` views the memory's keys, (S, B_mem, E), as (S, B * heads,
head_dim) with B the query's batch), but export records no equality: the view's element count is
all that ties them. A view only runs when its element count is kept, so B_mem = B on every call the
model can make. Unrecorded, the two symbols differ, and no rule can match the view's dims
(B_mem against B * heads), so the block is replicated. This step finds each view whose element
counts differ only by the ratio of two input-size symbols, and states their equality to the shape
environment (`torch._check`), which then writes every size in terms of one of them.
"""
from __future__ import annotations

from typing import Any, Optional

import sympy
import torch
from torch.fx import GraphModule, Node

from tpcompile.sharding_rules.rule_context import prod, to_size

_VIEWS = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default)


def record_size_equalities(gm: GraphModule) -> int:
    """State each equality of two input sizes that a view's element counts imply; return how many were stated."""
    symbols: dict[sympy.Symbol, torch.SymInt] = {}
    for node in gm.graph.nodes:
        val = node.meta.get("val") if node.op == "placeholder" else None
        for s in (val.shape if isinstance(val, torch.Tensor) else ()):
            if isinstance(s, torch.SymInt) and isinstance(s.node.expr, sympy.Symbol):
                symbols.setdefault(s.node.expr, s)
    stated = 0
    for node in gm.graph.nodes:
        pair = _implied(node) if node.op == "call_function" and node.target in _VIEWS else None
        if pair is not None and all(p in symbols for p in pair):
            torch._check(symbols[pair[0]] == symbols[pair[1]])
            stated += 1
    return stated


def _implied(view: Node) -> Optional[tuple[sympy.Symbol, sympy.Symbol]]:
    """(a, b) when the view keeps its element count only if input-size symbols a and b are equal, else None."""
    x = view.args[0] if view.args else None
    val = x.meta.get("val") if isinstance(x, Node) else None
    sizes = view.args[1] if len(view.args) > 1 else None
    if not isinstance(val, torch.Tensor) or not isinstance(sizes, (list, tuple)):
        return None
    outs = [_size(s) for s in sizes]
    if any(s is None or s == -1 for s in outs):
        return None
    ratio = sympy.simplify(sympy.sympify(prod([to_size(s) for s in val.shape])) / sympy.sympify(prod(outs)))
    num, den = sympy.fraction(ratio)
    if isinstance(num, sympy.Symbol) and isinstance(den, sympy.Symbol) and num != den:
        return num, den
    return None


def _size(s: Any) -> Any:
    """A view's size argument as an int or a sympy expression (a size node's value), else None."""
    if isinstance(s, int):
        return s
    val = s.meta.get("val") if isinstance(s, Node) else None
    return to_size(val) if isinstance(val, (int, torch.SymInt)) else None
