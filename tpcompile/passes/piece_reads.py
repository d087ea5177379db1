"""Parameters read in pieces: a weight cut apart in the graph (`w.split`, `chunk`, `narrow`, slicing)
before a matmul reads a piece of it.

`nn.MultiheadAttention` does this for cross-attention: it splits its packed `in_proj_weight` into
the query rows and the key/value rows and runs a `linear` on each. Pieces cut along a linear's output
rows, each read by one linear, are weights of their own (passes/param_pieces.py): they split, or stay
whole for a reason propagation names. Any other piece read (a weight cut along its input features, a
piece read by a matmul of activations or by several ops) has no rule, so such a weight stays whole on
every rank. Results stay exact, but each rank holds and multiplies the whole weight, and nothing else
names it: this check, run after propagation, says so for each such parameter, with the way out.
"""
from __future__ import annotations

import operator
import warnings
from typing import Optional

import torch
from torch import nn
from torch.fx import GraphModule, Node

from tpcompile.errors import TPCompileWarning
from tpcompile.passes.pass_context import PassContext, describe, owner_path
from tpcompile.sharding_rules import lookup

# rules of the op table (sharding_rules/ops.yaml) by what they do to a parameter on its way to a matmul
_CUTS = {"split", "slice", "select", "unbind"}  # cut it into pieces
_THROUGH = {"pointwise", "reshape", "transpose", "permute"}  # carry a piece on (casts, views, copies)
_MATMULS = {"weight_matmul", "matmul", "einsum"}


def _only_tensor_input(node: Node, x: Node) -> bool:
    """x is the one tensor node reads: a cast or a view of x, not x mixed with something else (`pos[:T] + h`)."""
    return all(a is x or not isinstance(a.meta.get("val"), torch.Tensor) for a in node.all_input_nodes)


def _piece_matmul(param: Node) -> Optional[tuple[Node, Node]]:
    """(the op that cut it, the matmul that reads a piece) for a parameter read in pieces, else None."""
    stack: list[tuple[Node, Optional[Node]]] = [(param, None)]
    seen: set[Node] = set()
    while stack:
        node, cut = stack.pop()
        for user in node.users:
            if user in seen or user.op != "call_function":
                continue
            seen.add(user)
            rule = getattr(lookup(user.target), "rule", None)
            spec = user.meta.get("tp_rule")
            if rule in _MATMULS and cut is not None and not (spec and (spec.get("weight_piece") or spec.get(
                    "bias_piece") or spec.get("view"))):  # row pieces, and experts' pieces picked by id, have rules
                return cut, user
            if rule in _CUTS:
                stack.append((user, cut or user))
            elif user.target is operator.getitem or (rule in _THROUGH and _only_tensor_input(user, node)):
                stack.append((user, cut))  # getitem takes a piece out of a split
    return None


def warn_pieces_read_whole(gm: GraphModule, ctx: PassContext) -> None:
    """Warn once per 2-D-or-more parameter that stays whole because a matmul reads it in pieces."""
    said: set[int] = set()  # a tied parameter read under two names is said once
    for node in gm.graph.nodes:
        if node.op != "get_attr" or ctx.slice_for(node.target) is not None:
            continue
        t = ctx.tensors.get(node.target)
        owner = owner_path(node.target)
        if not isinstance(t, nn.Parameter) or t.dim() < 2 or ctx.override_for(owner) == "replicate" or id(t) in said:
            continue
        found = _piece_matmul(node)
        if found is None:
            continue
        said.add(id(t))
        cut, matmul = found
        silence = (f"plan={{{owner!r}: 'replicate'}} says so explicitly and silences this" if owner else
                   "it belongs to the top-level module, which no plan entry names alone")
        msg = (f"{describe(matmul)} reads a piece of {node.target} {tuple(t.shape)}, cut by {describe(cut)}; no rule "
               f"splits a piece cut this way (only row pieces that one linear each reads do), so {node.target} "
               f"stays whole on every rank (results stay exact; each rank holds and multiplies all of it). "
               f"Holding the pieces as separate parameters (one nn.Linear each) lets them split; {silence}")
        ctx.warnings.append(msg)
        warnings.warn(msg, TPCompileWarning, stacklevel=4)
