"""Sizes of the model's inputs as values of a rank graph: the run-time batch and length a rewrite needs where the
captured graph has a symbolic size (a sequence's token count, the batch of (B*T, C) values). A size the inputs do
not give (a count the model computes from its data: patches) is learnt where a whole value has it (`learn_size`)."""
from __future__ import annotations

import operator
from typing import Any, Callable

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
                out = size_op(em, op, out, part)
            em.cache[key] = out
    return em.cache[key]


def learn_size(em: Any, expr: Any, make: Callable[[], Any]) -> None:
    """Record `make()` (a node of the rank graph, made only if needed) as the value of `expr`, a size no model input
    gives (a data-dependent count); when expr is a*u + b in one symbol u, u too (solved), so that other sizes made
    of u are found later."""
    expr = sympy.sympify(expr)
    if expr.is_number or ("size", str(expr)) in em.cache or expr.free_symbols <= _input_symbols(em):
        return
    em.cache[("size", str(expr))] = size = make()
    if len(expr.free_symbols) != 1:
        return
    (u,) = expr.free_symbols
    poly = sympy.Poly(expr, u)
    a, b = poly.all_coeffs() if poly.degree() == 1 else (None, None)
    if a is None or not (a.is_Integer and b.is_Integer) or ("size", str(u)) in em.cache:
        return
    base = size_op(em, operator.sub, size, int(b)) if b else size
    em.cache[("size", str(u))] = size_op(em, operator.floordiv, base, int(a)) if a != 1 else base


def size_op(em: Any, op: Any, a: Any, b: Any) -> Any:
    """op(a, b) on sizes, each an int or a node of the rank graph: an int of two ints, else a node (a product with
    1 is the other size, no node)."""
    if isinstance(a, int) and isinstance(b, int):
        return op(a, b)
    if op is operator.mul and (a == 1 or b == 1):
        return b if a == 1 else a
    return em.call(op, a, b)


def _input_symbols(em: Any) -> set:
    """The symbols that are a model input's size (each a dim of its own), which `size_node` finds."""
    if "input symbols" not in em.cache:
        dims = [d for ph in em.gm.graph.nodes if ph.op == "placeholder"
                for d in getattr(ph.meta.get("val"), "shape", ())]
        em.cache["input symbols"] = {d.node.expr for d in dims if isinstance(d, torch.SymInt) and d.node.expr.is_symbol}
    return em.cache["input symbols"]
