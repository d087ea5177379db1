"""What the padding of a zero-padded split holds: a constant worked out op by op, or not known.

The padding starts as zeros (a weight's padded rows, a whole value cut to the split and zero-padded) and the ops
after it compute on it as on real entries: sigmoid(0) = 0.5, 1 - exp(-0) = 0, rsqrt(0 + eps) = 1000. Where every
tensor operand's padding is a known constant, a pointwise op's padding is the op on those constants; layout ops,
casts and reductions over other dims keep it. Two questions are asked of it:
- can the padding hold an infinity (`finite_padding`)? A product with a zero padding is then nan, not zero
  (padded.zero_padded), and the product's gradient for its other factor is infinite there;
- is an op's derivative unbounded at its operands' padding (`derivative_finite`)? Its backward then gives
  0 x inf = nan at the padding (passes/rewrite_grad_mask.py).
"""
from __future__ import annotations

import math
import operator
from typing import Any, Callable, Optional, Union

import torch
from torch.fx import Node

from tpcompile.placement import PARTIAL, REPLICATE, Shard

Placement = Callable[[Node], Any]


class _Finite:
    """A padding known to be finite, its values not known (a real value broadcast over it, say)."""

    def __repr__(self) -> str:
        return "FINITE"


FINITE = _Finite()
Value = Union[float, _Finite, None]

# ops that can make an infinity of finite values (log(0), 1/0, 0^-1): a division by a padded divisor, a power by a
# negative exponent (`_makes_infinite`)
INFINITE_AT = frozenset((
    "aten.log.default", "aten.log2.default", "aten.log10.default", "aten.reciprocal.default", "aten.rsqrt.default",
    "aten.atanh.default", "aten.pow.Tensor_Tensor", "aten.tan.default"))
DIVISIONS = frozenset(("aten.div.Tensor", "aten.div.Tensor_mode", "aten.floor_divide.default",
                       "aten.remainder.Tensor"))
# ops that hand their (padded) operand's padding on: layouts, casts, copies, reductions over other dims
_KEEPS = frozenset((
    "aten.view.default aten.reshape.default aten._unsafe_view.default aten.transpose.int aten.permute.default "
    "aten.t.default aten.unsqueeze.default aten.squeeze.dim aten.squeeze.default aten.squeeze.dims "
    "aten.expand.default aten.flatten.using_ints aten.unflatten.int aten.slice.Tensor aten.select.int "
    "aten.contiguous.default aten.clone.default aten._to_copy.default aten.to.dtype aten.to.dtype_layout "
    "aten.to.device aten.to.other aten.type_as.default aten.alias.default aten.detach.default aten.mean.dim "
    "aten.amax.default aten.amin.default aten.cat.default aten.stack.default aten.split.Tensor "
    "aten.split_with_sizes.default aten.chunk.default aten.unbind.int aten.repeat_interleave.self_int "
    "aten.view_as_complex.default aten.view_as_real.default aten.reshape_as.default aten.view_as.default "
    "aten.expand_as.default aten.concatenate.default aten.flip.default aten.unfold.default aten.roll.default "
    "aten.narrow.default aten.movedim.int aten.repeat.default").split())
# reductions over other dims: of zeros zero (a sum, a norm); a spread of a constant zero whatever it is
_SPREADS = frozenset(("aten.var.correction", "aten.std.correction", "aten.var.dim", "aten.std.dim"))
_REDUCES = frozenset(("aten.sum.dim_IntList", "aten.linalg_vector_norm.default", "aten.norm.ScalarOpt_dim")) | _SPREADS
# elementwise ops that torch does not tag pointwise
_POINTWISE_UNTAGGED = frozenset(("aten.log_sigmoid.default", "aten.hardswish.default", "aten.hardsigmoid.default"))
_JOINS = frozenset(("aten.cat.default", "aten.concatenate.default", "aten.stack.default"))
SPLITS = frozenset(("aten.split.Tensor", "aten.split_with_sizes.default", "aten.chunk.default", "aten.unbind.int"))
_CONVS = frozenset(("aten.conv1d.default", "aten.conv2d.default", "aten.conv3d.default", "aten.convolution.default",
                    "aten._convolution.default"))
MULTILINEAR = frozenset(("aten.einsum.default", "aten.bmm.default", "aten.matmul.default", "aten.mm.default"))
NORMS = frozenset(("aten.layer_norm.default", "aten.rms_norm.default"))
_CONSTANTS = {"aten.zeros_like.default": 0.0, "aten.ones_like.default": 1.0, "aten.new_zeros.default": 0.0,
              "aten.new_ones.default": 1.0, "aten.full_like.default": None}
_FILLS = frozenset(("aten.pad.default", "aten.constant_pad_nd.default", "aten.masked_fill.Scalar"))
_LIMIT = 2000  # padded values a question walks back over at most


def is_padded(placement: Placement, n: Any) -> bool:
    """True for a value split with padding (zero-padded, or cut unevenly with each block padded)."""
    p = placement(n) if isinstance(n, Node) else None
    return isinstance(p, Shard) and (p.padding is not None or p.rank_cuts)


def padding_value(x: Node, placement: Placement, rule: Any = None, memo: Optional[dict] = None) -> Value:
    """The constant that the padding of `x` (a padded value) holds; FINITE when it is known finite only; None when
    it is not known."""
    memo = {} if memo is None else memo
    stack, steps = [(x, False)], 0
    while stack:  # the padded values behind x, each valued after its padded operands (no recursion: deep graphs)
        n, ready = stack.pop()
        if n in memo:
            continue
        steps += 1
        if ready or steps > _LIMIT:
            memo[n] = _value(n, placement, rule, memo) if ready else None
            continue
        stack.append((n, True))
        stack += [(a, False) for a in _operands(n) if is_padded(placement, a) and a not in memo]
    return memo[x]


def _operands(n: Node) -> list[Node]:
    """n's operands, a part of a split read through to the value split (the parts hold its padding)."""
    if n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], Node):
        src = n.args[0]
        split = src.op == "call_function" and str(src.target) in SPLITS and isinstance(src.args[0], Node)
        return [src.args[0] if split else src]
    return list(n.all_input_nodes) if n.op == "call_function" else []


def _value(n: Node, placement: Placement, rule: Any, memo: dict) -> Value:
    """n's padding from its operands' (already in memo): a constant, FINITE, or None (not known)."""
    from tpcompile.sharding_rules.table import op_name

    if n.op != "call_function":
        return 0.0  # a weight or input zero-padded
    padded = [a for a in _operands(n) if is_padded(placement, a)]
    values = {memo.get(a) for a in padded}
    name = "getitem" if n.target is operator.getitem else op_name(n.target).replace("_.", ".")
    if name in _CONSTANTS:
        return float(n.args[1]) if name == "aten.full_like.default" else _CONSTANTS[name]
    if name in _KEEPS and name not in _JOINS and is_padded(placement, n.args[0]):
        values = {memo.get(n.args[0])}  # (type_as's other operand gives a dtype only)
    if name in _REDUCES:  # over other dims, of entries holding one constant each: zero for zeros
        if not _all_finite(values):
            return None
        return 0.0 if values == {0.0} or name in _SPREADS and FINITE not in values else FINITE
    if name == "getitem" or name in _KEEPS:
        return values.pop() if len(values) == 1 else FINITE if _all_finite(values) else None
    if name in _FILLS:  # new entries of a fill along other dims, where the padding's may differ
        fill = n.args[2] if name == "aten.masked_fill.Scalar" else _pad_fill(n)
        v = memo.get(n.args[0])
        return v if isinstance(fill, (int, float)) and v == float(fill) else FINITE if _all_finite({v}) else None
    if name in _CONVS and len(n.args) > 1:  # a padded channel's output: its zero kernel (and bias) times any input
        w, b = n.args[1], n.args[2] if len(n.args) > 2 else None
        zero = lambda v: is_padded(placement, v) and memo.get(v) == 0.0  # noqa: E731
        return 0.0 if zero(w) and (b is None or zero(b)) and _all_finite(values) else None
    if name in NORMS:  # normalised (finite: eps), times the weight's zero padding (plus the bias's)
        zero = [a for a in n.args[2:4] if isinstance(a, Node)] if name == "aten.layer_norm.default" else n.args[2:3]
        return 0.0 if zero and all(is_padded(placement, a) and memo.get(a) == 0.0 for a in zero) \
            and _all_finite(values) else None
    if not _all_finite(values):
        return None
    if name == "aten.scaled_dot_product_attention.default":  # each query's weights sum to one: zero values, zero
        return 0.0 if memo.get(n.args[2]) == 0.0 and is_padded(placement, n.args[2]) else FINITE
    spec = (rule or (lambda m: m.meta.get("tp_rule")))(n)
    if spec is not None and spec.rule in ("weight_matmul", "weight_contract"):
        # a whole input times the weight's zero padded rows (and bias), as the parameter cuts make them; a padded
        # input whose padding is zero, without a bias
        i = spec.get("input") if spec.rule == "weight_matmul" else 0
        act = n.args[i] if i is not None and i < len(n.args) else None
        bi = spec.get("bias") if spec.rule == "weight_matmul" else None
        bias = n.args[bi] if bi is not None and bi < len(n.args) else None
        if not is_padded(placement, act):
            return 0.0
        return 0.0 if memo.get(act) == 0.0 and not isinstance(bias, Node) else FINITE
    if name in MULTILINEAR:  # sums of products: zero where one factor's padding is zero, the others finite
        return 0.0 if 0.0 in values else FINITE
    pointwise = isinstance(n.target, torch._ops.OpOverload) and torch.Tag.pointwise in n.target.tags
    if (pointwise or name in _POINTWISE_UNTAGGED) and padded:
        return _pointwise(n, name, padded, placement, memo)
    return None


def _pointwise(n: Node, name: str, padded: list, placement: Placement, memo: dict) -> Value:
    """A pointwise op of constants, evaluated; of finite values not all known, FINITE unless the op can make an
    infinity of them; a product by a zero padding zero."""
    args, known = [], True
    for a in n.args:
        if isinstance(a, Node) and isinstance(a.meta.get("val"), torch.Tensor):
            v = memo.get(a) if a in padded else 0.0 if cut_whole(a, n, placement) else FINITE  # cut: zero-padded
            if v is None:
                return None
            known = known and v is not FINITE
            args.append(torch.tensor(1.0 if v is FINITE else v, dtype=torch.float64))
        elif isinstance(a, Node):
            return None  # a run-time size
        else:
            args.append(a)
    if not known:
        if name == "aten.div.Tensor" and memo.get(n.args[0]) == 0.0 and not is_padded(placement, n.args[1]):
            return 0.0  # zeros over a real divisor
        if name == "aten.mul.Tensor" and any(isinstance(t, torch.Tensor) and float(t) == 0.0 for t in args):
            return 0.0 if _all_finite({memo.get(a) for a in padded}) else None  # (the others stood in as ones)
        return None if _makes_infinite(n, placement) else FINITE
    try:
        out = n.target(*args, **{k: v for k, v in n.kwargs.items() if k != "dtype"})
    except (RuntimeError, TypeError, ValueError):
        return None
    return float(out) if isinstance(out, torch.Tensor) and out.numel() == 1 else None


def _all_finite(values: set) -> bool:
    return all(v is FINITE or v is not None and math.isfinite(v) for v in values)


def _pad_fill(n: Node) -> Any:
    """The value a pad fills with (None for a mode other than constant)."""
    if str(n.target) == "aten.constant_pad_nd.default":
        return n.args[2] if len(n.args) > 2 else 0
    mode = n.args[2] if len(n.args) > 2 else n.kwargs.get("mode", "constant")
    value = n.args[3] if len(n.args) > 3 else n.kwargs.get("value")
    return (value or 0) if mode == "constant" else None


def finite_padding(x: Node, placement: Placement, rule: Any = None, memo: Optional[dict] = None) -> bool:
    """True when the padding of every padded operand of `x` is known to hold finite values: a known finite constant,
    or no op on the way back from it (over padded values whose padding is not known) that can make an infinity of
    finite values (`INFINITE_AT`; a division only by a padded divisor). A whole operand holds real values."""
    memo = {} if memo is None else memo  # (a frozen plan's values can be kept across questions)
    seen, todo = set(), [a for a in _operands(x) if is_padded(placement, a)]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if len(seen) > _LIMIT:
            return False
        v = padding_value(n, placement, rule, memo)
        if v is not None:
            if not _all_finite({v}):
                return False
            continue
        if n.op != "call_function":
            continue
        if _makes_infinite(n, placement):
            return False
        todo += [a for a in _operands(n) if is_padded(placement, a)]
    return True


def _makes_infinite(n: Node, placement: Placement) -> bool:
    name = "" if n.target is operator.getitem else str(n.target)
    if name == "aten.pow.Tensor_Scalar":
        return not (isinstance(n.args[1], (int, float)) and n.args[1] >= 0)
    return name in INFINITE_AT or name in DIVISIONS and len(n.args) > 1 and is_padded(placement, n.args[1])


def derivative_finite(x: Node, placement: Placement, rule: Any = None, memo: Optional[dict] = None) -> bool:
    """True when the padding of each padded operand of `x` is a known constant at which x's op has a finite
    derivative for every operand (its whole operands standing in as ones where the op is a division by the padding);
    False when a padding is not known."""
    memo = {} if memo is None else memo  # (a frozen plan's values can be kept across questions)
    args, leaves = [], []
    for a in x.args:
        if isinstance(a, Node) and isinstance(a.meta.get("val"), torch.Tensor):
            v = padding_value(a, placement, rule, memo) if is_padded(placement, a) else 1.0
            if v is None or v is FINITE or not is_padded(placement, a) and not str(x.target).startswith("aten.div"):
                return False
            leaves.append(torch.tensor(v, dtype=torch.float64, requires_grad=True))
            args.append(leaves[-1])
        elif isinstance(a, Node):
            return False
        else:
            args.append(a)
    try:
        with torch.enable_grad():
            out = x.target(*args)
            grads = torch.autograd.grad(out.sum(), leaves, allow_unused=True)
    except (RuntimeError, TypeError, ValueError):
        return False
    return all(g is None or bool(torch.isfinite(g).all()) for g in grads)


def cut_whole(a: Node, x: Node, placement: Placement) -> bool:
    """True when `a`, an operand of `x` held whole or a pending sum (reduced, then whole), has `x`'s padded dim at
    its full size: it is cut to the split (and zero-padded)."""
    dim = placement(x).dim - (x.meta["val"].dim() - a.meta["val"].dim())
    if placement(a) not in (REPLICATE, PARTIAL) or dim < 0:
        return False
    size, full = a.meta["val"].shape[dim], x.meta["val"].shape[placement(x).dim]
    return isinstance(size, int) and isinstance(full, int) and size == full  # not broadcast along it
