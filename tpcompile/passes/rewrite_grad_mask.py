"""Finite gradients at the padding: the inputs of an op whose derivative is unbounded where padding may sit.

The padding of a split the world size does not divide holds zeros, or what the ops since made of zeros: a rate
sliced from a whole value is zero-padded, exp(-0) is 1, 1 - 1 is 0. An op such as sqrt, log or a division has an
infinite derivative there; the gradient that reaches the padding is zero (the row split after it drops the padding),
so its backward gives 0 * inf = nan at the padding, and the nan crosses into real gradients through the padded rows
of the weights before it (nan * 0), and into the padded rows' own gradients (an optimizer step or a clipped norm
then spreads it). Each tensor input of such an op goes through `where(real, x, x.detach())` on a rank whose block
of a padded input holds padding: the same value forward, a gradient of exactly zero at the padding.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.fx import Node

from tpcompile.passes.rewrite_slices import padding_runs
from tpcompile.sharding_rules.padding_values import DIVISIONS, derivative_finite, finite_padding, is_padded

aten = torch.ops.aten

# Ops whose derivative is unbounded at a value padding may hold (0 for most; +-1 for the inverse trigonometric ones);
# and divisions (padding_values.DIVISIONS) by a padded divisor.
UNBOUNDED_DERIVATIVE = frozenset((
    "aten.sqrt.default", "aten.rsqrt.default", "aten.log.default", "aten.log2.default", "aten.log10.default",
    "aten.reciprocal.default", "aten.pow.Tensor_Tensor",
    "aten.atan2.default", "aten.acos.default", "aten.asin.default", "aten.atanh.default", "aten.xlogy.Tensor",
    "aten.special_xlog1py.default", "aten.linalg_vector_norm.default", "aten.norm.ScalarOpt_dim",
))
# A power's derivative x^(e-1) is unbounded at 0 for an exponent below one (other than 0).
_POW = "aten.pow.Tensor_Scalar"
# Ops whose other operands are not elementwise with the padded one: only the padded input is masked.
_ONE_INPUT = frozenset(("aten.linalg_vector_norm.default", "aten.norm.ScalarOpt_dim"))


def unbounded_at_padding(node: Node, placement: Callable[[Node], Any]) -> bool:
    """True for an op of the table (a power by an exponent below one included; a division only by a padded
    divisor: over real values or a number its derivatives are bounded)."""
    name = str(node.target)
    if name == _POW:
        e = node.args[1]
        return isinstance(e, (int, float)) and e < 1 and e != 0
    if name in DIVISIONS:
        return len(node.args) > 1 and is_padded(placement, node.args[1])
    return name in UNBOUNDED_DERIVATIVE


def grad_masked(em: Any, node: Node, lookup: Callable[[Node], Node]) -> Callable[[Node], Node]:
    """`lookup` with the tensor inputs of an op of the table, or of an op with an operand whose padding may hold an
    infinity (the gradient of x * (1 / s) for x is 1 / s), masked at this rank's padding (unchanged otherwise)."""
    if node.op != "call_function":
        return lookup
    at, rule, memo = em.plan.placement, em.plan.rule, em.cache.setdefault(("padding_values",), {})
    singular = unbounded_at_padding(node, at) and not derivative_finite(node, at, rule, memo)
    if not (singular or not finite_padding(node, at, rule, memo)):
        return lookup
    masks = [m for m in (_mask(em, a, lookup(a)) for a in node.all_input_nodes) if m is not None]
    if not masks:
        return lookup
    inputs = [node.all_input_nodes[0]] if str(node.target) in _ONE_INPUT else node.all_input_nodes
    masked = {}
    for a in inputs:
        if isinstance(a.meta.get("val"), torch.Tensor):
            x = lookup(a)
            for mask in masks:
                x = em.call(aten.where.self, mask, x, em.call(aten.detach.default, x))
            masked[a] = x
    return lambda n: masked.get(n, lookup(n))


def _mask(em: Any, src: Node, x: Node) -> Node | None:
    """The boolean mask of this rank's real entries of `src` along its padded dim (shaped to broadcast), or None when
    its block holds no padding."""
    runs = padding_runs(em, src)
    if runs is None:
        return None
    after = src.meta["val"].dim() - em.plan.placement(src).dim  # the padded dim and those after it
    key = ("padding_mask", tuple((n, block) for _, n, block in runs), after)
    if key not in em.cache:
        parts = []
        for _, n, block in runs:
            parts += [em.call(aten.new_ones.default, x, [n], dtype=torch.bool)] if n else []
            parts += [em.call(aten.new_zeros.default, x, [block - n], dtype=torch.bool)] if block > n else []
        mask = parts[0] if len(parts) == 1 else em.call(aten.cat.default, parts)
        em.cache[key] = em.call(aten.view.default, mask, [-1] + [1] * (after - 1))
    return em.cache[key]
