"""Parameters read in pieces: a weight cut apart in the graph (`w.split`, `chunk`, `narrow`, slicing)
before a matmul reads a piece of it.

`nn.MultiheadAttention` does this for cross-attention: it splits its packed `in_proj_weight` into
the query rows and the key/value rows and runs a `linear` on each. No sharding rule splits a piece of a
parameter, so such a weight stays whole on every rank. Results stay exact, but each rank holds and
multiplies the whole weight, and nothing else names it: this check, run after propagation, says so
for each such parameter, with the way out.
"""
from __future__ import annotations

import operator
import warnings
from typing import Optional

from torch import nn
from torch.fx import GraphModule, Node

from tpcompile.errors import TPCompileWarning
from tpcompile.passes.pass_context import PassContext, describe, owner_path
from tpcompile.sharding_rules import op_name

# ops that cut a parameter into pieces
_CUTS = {"aten.split.Tensor", "aten.split_with_sizes.default", "aten.chunk.default", "aten.narrow.default",
         "aten.slice.Tensor", "aten.unsafe_split.Tensor", "aten.tensor_split.sections", "aten.select.int"}
# ops a piece passes through on its way to the matmul (getitem takes a piece out of a split)
_THROUGH = {"aten.t.default", "aten.transpose.int", "aten.permute.default", "aten.view.default",
            "aten.reshape.default", "aten.to.dtype", "aten._to_copy.default", "aten.contiguous.default",
            "aten.unflatten.int", "aten.clone.default", "aten.alias.default", "aten.detach.default"}
_MATMULS = {"aten.linear.default", "aten.mm.default", "aten.bmm.default", "aten.matmul.default",
            "aten.addmm.default", "aten.baddbmm.default", "aten.einsum.default"}


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
            name = op_name(user.target)
            if name in _MATMULS and cut is not None:
                return cut, user
            if name in _CUTS:
                stack.append((user, cut or user))
            elif user.target is operator.getitem or name in _THROUGH:
                stack.append((user, cut))
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
               f"splits part of a parameter, so {node.target} stays whole on every rank (results stay exact; "
               f"each rank holds and multiplies all of it). Holding the pieces as separate parameters (one "
               f"nn.Linear each) lets them split; {silence}")
        ctx.warnings.append(msg)
        warnings.warn(msg, TPCompileWarning, stacklevel=4)
