"""What one captured node costs: matmul FLOPs, elements moved, whether it computes and what it keeps.

Read off node.meta['val'] (fake tensors, static shapes at the planning sizes). Matmul-like ops
(linear, mm, addmm, bmm, baddbmm, matmul, scaled dot-product attention) count 2 FLOPs per
multiply-add; every other computing op is memory-bound and counts the elements it reads and
writes. View ops (an aten schema whose result aliases an input) and getitem compute nothing.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Iterable

import torch
from torch.fx import Node

aten = torch.ops.aten

_MATMULS = {aten.linear.default, aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
            aten.matmul.default}
_ATTENTION = {aten.scaled_dot_product_attention.default}
for _name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
              "_scaled_dot_product_flash_attention_for_cpu"):
    if hasattr(aten, _name):
        _ATTENTION.add(getattr(aten, _name).default)


def tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a node's meta value (a tensor, or a tuple / list of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors(v)]
    return []


def numel(value: Any) -> int:
    """Elements of every tensor in a meta value."""
    return sum(math.prod(int(s) for s in t.shape) for t in tensors(value))


def is_view(node: Node) -> bool:
    """True for ops that only re-describe an input (views, getitem) or produce nothing."""
    if node.op != "call_function":
        return True
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return False
    if not schema.returns:
        return True  # asserts and other checks
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def is_matmul(node: Node) -> bool:
    """True for the matmul-like ops whose time is their FLOPs."""
    return node.op == "call_function" and (node.target in _MATMULS or node.target in _ATTENTION)


def _shape(arg: Any) -> tuple[int, ...]:
    val = arg.meta.get("val") if isinstance(arg, Node) else arg
    return tuple(int(s) for s in val.shape) if isinstance(val, torch.Tensor) else ()


def matmul_flops(node: Node) -> float:
    """2 x multiply-adds of a matmul-like node (0 for anything else)."""
    if node.target in _ATTENTION:
        q, k, v = (_shape(a) for a in node.args[:3])
        if len(q) < 2 or len(k) < 2 or len(v) < 2:
            return 0.0
        batch = math.prod(q[:-2])
        # QK^T: (Lq x E) @ (E x S); attention-weighted values: (Lq x S) @ (S x Ev)
        return 2.0 * batch * q[-2] * k[-2] * (q[-1] + v[-1])
    if node.target not in _MATMULS:
        return 0.0
    out = numel(node.meta.get("val"))
    first = node.args[1] if node.target in (aten.addmm.default, aten.baddbmm.default) else node.args[0]
    inner = _shape(first)
    return 2.0 * out * (inner[-1] if inner else 1)


def moved_elements(node: Node) -> int:
    """Elements a memory-bound op reads and writes (its tensor inputs and outputs)."""
    ins = sum(numel(a.meta.get("val")) for a in node.all_input_nodes)
    return ins + numel(node.meta.get("val"))


def is_float(node: Node) -> bool:
    """True when the node's value holds floating-point tensors (activations, not masks or ids)."""
    ts = tensors(node.meta.get("val"))
    return bool(ts) and all(t.dtype.is_floating_point for t in ts)


def input_dependent(nodes: Iterable[Node]) -> set[Node]:
    """Nodes whose value depends on the model's inputs (placeholders), in one forward sweep."""
    live: set[Node] = set()
    for node in nodes:
        if node.op == "placeholder" and tensors(node.meta.get("val")):
            live.add(node)
        elif node.op in ("call_function", "call_method", "call_module") and any(
                a in live for a in node.all_input_nodes):
            live.add(node)
    return live
