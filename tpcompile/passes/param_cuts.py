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
from tpcompile.sharding_rules.rule_context import param_behind, readers


def wished_cut(node: Any, want: Any, param: Callable[[Any], Optional[torch.Tensor]],
               world_size: int) -> Optional[tuple[str, ParamSlice]]:
    """(parameter name, slice) when `node`, wanted split as `want`, is a parameter seen through in-place ops
    that nothing else reads, and cutting the parameter would give each rank exactly its part; else None."""
    if not (isinstance(want, Shard) and (want.plain or want.plain_padded) and not want.seq) \
            or not isinstance(node, Node) \
            or len(readers(node)) != 1:
        return None
    found = param_behind(node, want.dim, sole=True)
    if found is None:
        return None
    attr, d = found
    t = param(attr)
    if t is None:
        return None
    if want.padded is not None:  # zero-padded like the value it meets (a norm weight over padded heads)
        return None if want.padded % world_size else (str(attr.target), ParamSlice(d, padded=want.padded))
    if t.shape[d] % world_size:
        return None
    return str(attr.target), ParamSlice(d)
