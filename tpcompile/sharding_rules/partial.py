"""Pending sums: a row split's result left unreduced while the ops after it are linear in it.

A row split (a weight op whose input is split on the contracted dim) leaves each rank a summand
of its result: `Partial`. Reducing at once costs one all-reduce per row split, and a mixture of
experts has one row split per expert plus the shared expert's. Their results are scaled by the
router's weights, gathered back into token order and summed, which is all linear, so the sum is
left pending through such ops and reduced where an op needs the whole value (the residual add, a
norm): one all-reduce per MoE layer, as in Megatron's MoE layers (DTensor calls it Partial("sum")).

`partial_result` wraps the op's rule: when an input is pending and the op is linear in it, the
output is pending too; when the op only reads its shape, the input stays pending; otherwise the
rule sees the pending inputs as whole values, and the rewriter all-reduces them first.
"""
from __future__ import annotations

import operator
from typing import Any, Callable, Optional

import torch
from torch.fx import Node

from tpcompile.placement import PARTIAL, REPLICATE, Partial, Replicate
from tpcompile.sharding_rules.rule_context import Result, RuleContext, Want
from tpcompile.sharding_rules.table import op_name

# Linear in argument 0 (the rest: sizes, dims, indices, all whole).
_FIRST = {f"aten.{n}" for n in (
    "view.default", "reshape.default", "_unsafe_view.default", "flatten.using_ints", "unflatten.int",
    "unsqueeze.default", "squeeze.dim", "squeeze.dims", "squeeze.default", "transpose.int", "t.default",
    "permute.default", "numpy_T.default", "expand.default", "clone.default", "contiguous.default", "alias.default",
    "to.dtype", "to.dtype_layout", "_to_copy.default", "select.int", "slice.Tensor", "index.Tensor",
    "index_select.default", "gather.default", "narrow.default", "split.Tensor", "split_with_sizes.default",
    "chunk.default", "unbind.int", "neg.default", "mul.Scalar", "div.Scalar", "sum.dim_IntList", "sum.default",
    "mean.dim", "repeat.default", "repeat_interleave.self_int", "dropout.default")}
# Linear in the one pending operand when every other operand is whole (a product).
_ONE = {"aten.mul.Tensor": None, "aten.div.Tensor": (0,), "aten.mm.default": None, "aten.bmm.default": None,
        "aten.matmul.default": None, "aten.einsum.default": None}
# Linear jointly in these arguments: each pending or zeros (a sum, a scatter into zeros, a selection).
_JOINT = {"aten.add.Tensor": (0, 1), "aten.sub.Tensor": (0, 1), "aten.add_.Tensor": (0, 1),
          "aten.cat.default": (0,), "aten.stack.default": (0,), "aten.where.self": (1, 2),
          "aten.index_add.default": (0, 3), "aten.index_add_.default": (0, 3), "aten.index_put.default": (0, 2),
          "aten.index_put_.default": (0, 2), "aten.scatter_add.default": (0, 3), "aten.scatter.src": (0, 3)}
_INPLACE = {"aten.add_.Tensor", "aten.index_add_.default", "aten.index_put_.default"}
# Ops that read only their input's shape, dtype or device: a pending input stays pending.
_SHAPE_ONLY = {f"aten.{n}" for n in (
    "sym_size.int", "sym_numel.default", "sym_stride.int", "zeros_like.default", "ones_like.default",
    "empty_like.default", "full_like.default", "new_zeros.default", "new_ones.default", "new_empty.default",
    "new_full.default", "_assert_tensor_metadata.default")}
_KEEPS = _FIRST | set(_ONE) | set(_JOINT) | _SHAPE_ONLY  # ops that may keep a sum pending
# Ops that move a value's entries without combining them (each output entry is one input entry): the ops linear
# in argument 0 but those that scale, reduce, repeat or gather.
_MOVES = _FIRST - {f"aten.{n}" for n in (
    "neg.default", "mul.Scalar", "div.Scalar", "sum.dim_IntList", "sum.default", "mean.dim", "repeat.default",
    "repeat_interleave.self_int", "dropout.default", "index.Tensor", "index_select.default", "gather.default")}
_ZEROS = {"aten.zeros_like.default", "aten.zeros.default", "aten.new_zeros.default"}
_FULL = {"aten.full.default": 1, "aten.full_like.default": 1, "aten.new_full.default": 2}


def partial_result(node: Node, rules: RuleContext, placement: Callable[[Any], Any],
                   inner: Callable[[Node, RuleContext, Any], Result]) -> Result:
    """`inner`'s answer for the node (its rule), kept pending where the op is linear in its pending inputs."""
    summed = {i for i in node.all_input_nodes if isinstance(placement(i), Partial) and _summed_anyway(i)}
    if summed:  # read the sum another reader needs anyway: one all-reduce, not a second one later
        given = placement

        def placement(n: Any) -> Any:
            return REPLICATE if n in summed else given(n)
        rules = rules.seeing(placement)
    pending = [i for i in node.all_input_nodes if isinstance(placement(i), Partial)]
    if not pending:
        return inner(node, rules, placement)
    spec = node.meta.get("tp_rule")
    seed = spec is not None and spec.get("owner") is not None  # a weight op splits its weight on the whole input
    kept = None if seed else _linear(node, rules, placement)
    if kept is not None:
        return kept

    def whole(n: Any) -> Any:  # what the rule sees: pending sums as the whole values an all-reduce makes
        p = placement(n)
        return REPLICATE if isinstance(p, Partial) else p
    return inner(node, rules.seeing(whole), whole)


def _summed_anyway(value: Node) -> bool:
    """True when a reader of the pending `value` needs it whole (an op not linear in it, a weight op, the
    graph's output), so that its all-reduce happens whatever the other readers do; or when it is read in
    several places."""
    for u in value.users:
        if u.op != "call_function":
            return True
        spec = u.meta.get("tp_rule")
        if spec is not None and spec.get("owner") is not None:
            return True
        if u.target is not operator.getitem and op_name(u.target) not in _KEEPS:
            return True
    return _exits(value) > 1


def _exits(value: Node, limit: int = 64) -> int:
    """How many ops read `value` or pieces of it (through views, slices, selections and casts): a sum read in
    several places (x_proj's output cut into dt, B and C, C read token by token) is summed once, at its
    source, rather than once per piece."""
    seen, todo, exits = set(), [value], set()
    while todo and len(seen) < limit:
        n = todo.pop()
        for u in n.users:
            if u in seen:
                continue
            seen.add(u)
            if u.target is operator.getitem or op_name(u.target) in _MOVES:
                todo.append(u)
            elif op_name(u.target) not in _SHAPE_ONLY:
                exits.add(u)
    return len(exits)


def _flat(args: Any) -> list:
    out: list = []
    for a in args:
        out.extend(a if isinstance(a, (list, tuple)) else [a])
    return out


def _float_out(node: Node) -> bool:
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    return bool(vals) and all(isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()) for v in vals)


def _out(node: Node) -> Any:
    val = node.meta.get("val")
    return tuple(PARTIAL for _ in val) if isinstance(val, (list, tuple)) else PARTIAL


def _linear(node: Node, rules: RuleContext, placement: Callable[[Any], Any]) -> Optional[Result]:
    """A pending output when the op is linear in its pending inputs and its other inputs are whole, else None."""
    name = op_name(node.target)
    tensors = [a for a in _flat(list(node.args) + list(node.kwargs.values())) if rules.is_tensor(a)]
    if name in _SHAPE_ONLY:
        return Result(REPLICATE if node.meta.get("val") is not None else None,
                      [Want(n, placement(n)) for n in tensors])
    if not _float_out(node):
        return None
    if name in _FIRST:
        values = [node.args[0]]
        if name == "aten.dropout.default" and len(node.args) > 2 and node.args[2]:
            return None  # live dropout: masks drawn per rank would not add up
    elif name in _ONE:
        operands = _flat(node.args[1:2]) if name == "aten.einsum.default" else [a for a in node.args[:2]]
        values = [a for a in operands if isinstance(placement(a), Partial)]
        allowed = _ONE[name]
        if len(values) != 1 or (allowed is not None and node.args.index(values[0]) not in allowed):
            return None
    elif name in _JOINT:
        values = _flat([node.args[i] for i in _JOINT[name] if i < len(node.args)])
        if not all(isinstance(placement(v), Partial) or (_is_zero(v) and isinstance(placement(v), Replicate))
                   for v in values):
            return None
        if name in _INPLACE and not isinstance(placement(node.args[0]), Partial):
            return None  # it would write a pending sum into a whole value in place
    else:
        return None
    wants = []
    for n in tensors:
        p = placement(n)
        if n in values:
            wants.append(Want(n, p))  # pending, or zeros: a sum of zeros is zero
        elif isinstance(p, Replicate):
            wants.append(Want(n, REPLICATE, grad_sync=rules.requires_grad(n)))  # its gradient is a summand too
        else:
            return None  # split or pending operands elsewhere: not linear in one pending value
    return Result(_out(node), wants)


def _is_zero(n: Any, depth: int = 4) -> bool:
    """True for a tensor known to be all zeros (torch.zeros, zeros_like, full(0), or a view of one)."""
    if not isinstance(n, Node) or n.op != "call_function":
        return False
    name = op_name(n.target)
    if name in _ZEROS:
        return True
    if name in _FULL:
        i = _FULL[name]
        return i < len(n.args) and n.args[i] == 0
    return depth > 0 and name in _FIRST and bool(n.args) and _is_zero(n.args[0], depth - 1)
