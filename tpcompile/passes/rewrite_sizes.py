"""Sizes of the model's inputs as values of a rank graph: the run-time batch and length a rewrite needs where the
captured graph has a symbolic size (a sequence's token count, the batch of (B*T, C) values)."""
from __future__ import annotations

import operator
from typing import Any

import sympy
import torch
from torch.utils._sympy.functions import FloorDiv

aten = torch.ops.aten

_ARITHMETIC = {sympy.Mul: operator.mul, sympy.Add: operator.add, FloorDiv: operator.floordiv}


def size_node(em: Any, expr: Any) -> Any:
    """A size of the model's inputs (an int, a sympy symbol, or sums, products and floor divisions of them) as a
    value of the rank graph; ValueError when a symbol is no input's size."""
    if isinstance(expr, int) or getattr(expr, "is_number", False):
        return int(expr)
    key = ("size", str(expr))
    if key not in em.cache:
        for ph in em.gm.graph.nodes:
            dims = getattr(ph.meta.get("val"), "shape", ()) if ph.op == "placeholder" else ()
            i = next((i for i, d in enumerate(dims) if isinstance(d, torch.SymInt)
                      and sympy.simplify(d.node.expr - sympy.sympify(expr)) == 0), None)
            if i is not None:
                em.cache[key] = em.call(aten.sym_size.int, em.env[ph], i)
                break
        else:  # sums, products and floor divisions of the inputs' sizes (batch x tokens, patches), made from them
            expr = sympy.sympify(expr)
            op = _ARITHMETIC.get(type(expr))
            if op is None:
                raise ValueError(f"no model input has a dim of size {expr}")
            parts = [size_node(em, a) for a in expr.args]
            out = parts[0]
            for part in parts[1:]:
                out = op(out, part) if isinstance(out, int) and isinstance(part, int) else em.call(op, out, part)
            em.cache[key] = out
    return em.cache[key]
