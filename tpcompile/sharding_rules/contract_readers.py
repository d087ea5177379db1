"""Which output index of a weight contraction to split: the one its readers need split.

A parameter laid out (heads, head_dim, dim) read by `einsum("btd,hed->bthe", x, w)`, or packed as
(3, heads, head_dim, dim) and read by `einsum("btd,shed->sbthe", x, w_qkv)`, gives a column split
several output indices to choose from; so does a 3-D expert weight read by `einsum("btd,eod->bteo")`.
The equation cannot tell heads from experts; the readers can. Attention contracts q with k over head_dim
and keeps the heads as an index of both operands; a stacked q|k|v index is unbound; experts are summed
against the router's weights. `index_needs` follows the output of the contraction along each candidate
index through the ops that keep it (elementwise ops, transposes, unbinds and selects along other dims,
reshapes that keep whole blocks) to the first op that decides, and scores the index:

- WANTED: an index both operands of an activation contraction carry (einsum, bmm), or SDPA's heads: the
  other operand's split meets it there (whole heads);
- TAKEN: an op that runs on a split of it (a weight op contracting it, the output, an op with no verdict);
- REFUSED: summed against another activation, unbound, selected, reduced or softmaxed along, a reshape
  that cuts through its blocks.

A path refused anywhere refuses the index; one wanted anywhere wants it. `weight_contract` splits a wanted
index, zero-padded where the world size does not divide it (4 heads at 8 ranks: their head_dim of 8 would not
meet the other operand's heads), else the best-scored index the world size divides, the innermost parameter dim
among equals (the features).
"""
from __future__ import annotations

import operator
from typing import Union

from torch.fx import Node

from tpcompile.placement import Shard
from tpcompile.sharding_rules.einsum import parse
from tpcompile.sharding_rules.rule_context import RuleContext, norm_dim, readers
from tpcompile.sharding_rules.shape import reshape_placement
from tpcompile.sharding_rules.table import lookup, op_name

REFUSED, TAKEN, WANTED = 0, 1, 2
Step = Union[int, list[tuple[Node, int]]]  # a verdict, or the (value, dim) pairs to follow


def index_needs(node: Node, equation: str, world_size: int, limit: int = 64) -> dict[str, int]:
    """Per output index of the contraction `act,weight->out` that only the weight carries, how its readers take
    a split of it (REFUSED / TAKEN / WANTED); empty when there is at most one such index."""
    (ta, tw), out = equation.split("->")[0].split(","), equation.split("->")[1]
    candidates = [c for c in tw if c in out and c not in ta]
    if len(candidates) < 2:
        return {}
    return {c: _score(node, out.index(c), world_size, limit) for c in candidates}


def _score(value: Node, dim: int, ws: int, limit: int) -> int:
    todo, seen, wanted = [(value, dim)], 0, False
    while todo and seen < limit:
        n, d = todo.pop()
        for u in readers(n):
            seen += 1
            step = _step(u, n, d, ws)
            if step == REFUSED:
                return REFUSED
            if isinstance(step, list):
                todo.extend(step)
            wanted |= step == WANTED
    return WANTED if wanted else TAKEN


def _ndim(n: Node) -> int:
    return len(RuleContext.shape(n) or ())


def _dim_arg(u: Node, i: int, default: int = 0) -> int:
    dim = u.args[i] if len(u.args) > i else u.kwargs.get("dim", default)
    return norm_dim(dim, _ndim(u.args[0])) if isinstance(dim, int) else -1


def _items(u: Node, d: int) -> list[tuple[Node, int]]:
    """The parts of a multi-output op (unbind, split) its readers take, each with the followed dim."""
    return [(g, d) for g in u.users if g.target is operator.getitem]


def _step(u: Node, n: Node, d: int, ws: int) -> Step:
    """What reader `u` of value `n` does with a split of its dim `d`."""
    if u.op != "call_function":
        return TAKEN  # the output, or a submodule: it takes what it is given
    spec = lookup(u.target)
    rule = spec.rule if spec is not None else None
    if rule == "pointwise" and RuleContext.shape(u) is not None:
        return [(u, d + _ndim(u) - _ndim(n))]
    if rule in ("transpose", "permute", "reverse"):
        return [(u, _moved(u, d))]
    if rule == "reshape":
        out, _ = reshape_placement(Shard(d), RuleContext.shape(n), RuleContext.shape(u), ws)
        return REFUSED if out is None else [(u, out.dim)]
    if rule in ("unbind", "select"):
        at = _dim_arg(u, 1)
        if at == d:
            return REFUSED
        follow = d - (at < d)
        return _items(u, follow) if rule == "unbind" else [(u, follow)]
    if rule == "split":
        return TAKEN if _dim_arg(u, 2) == d else _items(u, d)
    if rule in ("softmax", "along_dim"):
        return REFUSED if _dim_arg(u, spec.get("dim_arg")) == d else [(u, d)]
    if rule == "einsum":
        return _einsum(u, n, d)
    if rule == "weight_matmul":
        x, w = (u.args[spec.get(k)] if spec.get(k) is not None and spec.get(k) < len(u.args) else None
                for k in ("input", "weight"))
        if _is_param(w):  # a linear / x @ W: fine only on its input's features
            return TAKEN if n is x and d == _ndim(n) - 1 else REFUSED
    if rule in ("matmul", "weight_matmul") and n in u.args[:2]:
        return _matmul(u, n, d)
    if rule == "sdpa" and n in u.args[:3]:
        return WANTED if d == 1 else REFUSED
    return TAKEN


def _moved(u: Node, d: int) -> int:
    nd = _ndim(u)
    if len(u.args) > 1 and isinstance(u.args[1], (list, tuple)):  # permute
        return [norm_dim(x, nd) for x in u.args[1]].index(d)
    if len(u.args) > 2:  # transpose
        a, b = norm_dim(u.args[1], nd), norm_dim(u.args[2], nd)
        return b if d == a else a if d == b else d
    return nd - 1 - d  # t, numpy_T


def _einsum(u: Node, n: Node, d: int) -> Step:
    parsed = parse(u.args[0])
    operands = list(u.args[1])
    if parsed is None or len(parsed[0]) != len(operands):
        return TAKEN
    terms, out = parsed
    mine = [t for a, t in zip(operands, terms) if a is n]
    others = [(a, t) for a, t in zip(operands, terms) if a is not n]
    letter = mine[0][d]
    weights = [a for a, _ in others if _is_param(a)]
    if letter not in out:  # contracted: a row split against a weight, refused against an activation
        return TAKEN if weights else REFUSED
    if any(letter in t for a, t in others if a not in weights):
        return WANTED
    return [(u, out.index(letter))]


def _matmul(u: Node, n: Node, d: int) -> Step:
    """A matmul of two activations: the contracted dim refused, a batch dim both carry wanted."""
    a, b = u.args[0], u.args[1]
    nd, nout = _ndim(n), _ndim(u)
    if (n is a and d == nd - 1) or (n is b and d == nd - 2):
        return REFUSED  # the contracted dim
    if d >= nd - 2:
        return [(u, d + nout - nd)]
    other = b if n is a else a
    od = d + _ndim(other) - nd
    shape = RuleContext.shape(other) or ()
    return WANTED if 0 <= od < len(shape) and shape[od] != 1 else [(u, d + nout - nd)]


_VIEWS = ("aten.t.default", "aten.transpose.int", "aten.permute.default", "aten.numpy_T.default",
          "aten.select.int", "aten.index.Tensor")


def _is_param(a: object) -> bool:
    """A parameter read (maybe through transposes, a select, a gather), which makes its contraction a weight op."""
    for _ in range(4):
        if not isinstance(a, Node):
            return False
        if a.op == "get_attr":
            return True
        a = a.args[0] if a.op == "call_function" and op_name(a.target) in _VIEWS and a.args else None
    return False
