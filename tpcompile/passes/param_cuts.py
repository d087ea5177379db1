"""Parameters cut where their only reader takes a slice of them.

A small parameter combined elementwise with a split value (Mamba's `A_log`, `D` and `dt_proj.bias`
against the split inner channels; a norm's weight against a value split on its features) is
wanted split by that op. Read whole, each rank would hold all of it and cut its slice at run
time. When the parameter reaches that op only through ops that keep its elements in place (casts,
unary elementwise ops, unsqueeze, squeeze, transpose), each with no other reader, the parameter
is stored cut instead, and the ops before the reader run on the slice. Such a cut is a wish, not
a demand: it is made only when every wish for the parameter agrees, no weight op cuts it and
the parameter has one name (not tied) (Sweep.settle_parameters), so it never creates a conflict.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.fx import Node

from tpcompile.placement import ParamSlice, Shard
from tpcompile.sharding_rules.table import op_name

aten = torch.ops.aten
_IN_PLACE = {"aten.to.dtype", "aten._to_copy.default", "aten.clone.default", "aten.detach.default",
             "aten.alias.default", "aten.exp.default", "aten.neg.default", "aten.float.default",
             "aten.sigmoid.default", "aten.tanh.default", "aten.abs.default"}


def _readers(node: Node) -> list[Node]:
    """The users of node that read its values (metadata assertions and size reads aside)."""
    return [u for u in node.users if u.target not in (aten._assert_tensor_metadata.default, aten.sym_size.int)]


def _input_dim(node: Node, d: int) -> Optional[int]:
    """The dim of node's first input that dim d of its output holds (None where no input dim does)."""
    name, args = op_name(node.target), node.args
    if name in _IN_PLACE:
        return d
    ndim = node.meta["val"].dim()
    if name == "aten.unsqueeze.default":
        k = args[1] % ndim
        return None if k == d else d - (k < d)
    if name == "aten.squeeze.dim":
        k = args[1] % args[0].meta["val"].dim()
        return d + (k <= d)
    if name == "aten.transpose.int":
        a, b = args[1] % ndim, args[2] % ndim
        return b if d == a else a if d == b else d
    return None


def wished_cut(node: Any, want: Any, param: Callable[[Any], Optional[torch.Tensor]],
               world_size: int) -> Optional[tuple[str, ParamSlice]]:
    """(parameter name, slice) when `node`, wanted split as `want`, is a parameter seen through in-place ops
    that nothing else reads, and cutting the parameter would give each rank exactly its part; else None."""
    if not (isinstance(want, Shard) and want.plain and not want.seq) or not isinstance(node, Node):
        return None
    d = want.dim
    if len(_readers(node)) != 1:
        return None
    for _ in range(8):
        if node.op == "get_attr":
            t = param(node)
            if t is None or len(_readers(node)) != 1 or t.shape[d] % world_size:
                return None
            return str(node.target), ParamSlice(d)
        if node.op != "call_function" or not node.args or not isinstance(node.args[0], Node):
            return None
        src = node.args[0]
        if len(_readers(src)) != 1 or any(isinstance(a, Node) for a in node.args[1:]):
            return None
        d = _input_dim(node, d)
        if d is None:
            return None
        node = src
    return None
