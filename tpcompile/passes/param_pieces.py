"""Parameters read in pieces by linear layers: each piece a weight of its own (annotate).

`nn.MultiheadAttention` in cross-attention cuts its packed `in_proj_weight` (3E, E) into the query
rows [0:E] and the key/value rows [E:3E] (`split_with_sizes`), and its bias alike, then runs one
`linear` per piece. Each such linear is marked with the piece it reads (`weight_piece`,
`bias_piece`: a `ParamPiece`), and the rule (sharding_rules/pieces.py) splits it as a weight op
of its own: by its own segments and heads (the key/value piece is two segments), the parameter's
per-rank slice made of the rank's rows of every segment of every piece (q[r] | k[r] | v[r], as a
fused q|k|v projection read whole is). The cut (`split`, `chunk`, `slice` along the rows) then
runs on the rank's slice at local sizes, at the segment boundaries the split rule accepts.

Only cuts along a linear's output rows (dim 0 of `F.linear`'s weight, of its bias), whose every
piece goes to one linear and nothing else, are marked; a parameter with another name (tied) is
not. Anything else read in pieces stays whole, and passes/piece_reads.py names it.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from torch.fx import GraphModule, Node

from tpcompile.passes.pass_context import PassContext, owner_path
from tpcompile.sharding_rules import RuleSpec, lookup
from tpcompile.sharding_rules.rule_context import readers

Part = tuple[tuple[int, ...], Optional[tuple[Optional[int], ...]]]  # a piece's segments and their head sizes


@dataclass(frozen=True)
class ParamPiece:
    """One piece of a parameter cut along its rows, read by one linear layer as its weight or bias."""

    param: Node  # the get_attr node
    nodes: tuple[Node, ...]  # the ops from the parameter to the piece: the cut (and its getitem)
    index: int  # which piece, in row order
    parts: tuple[Part, ...]  # every piece's segments and head sizes, in row order (the parameter's layout)

    @property
    def segments(self) -> tuple[int, ...]:
        """The parameter's rows as the concatenation of every piece's segments."""
        return tuple(s for segs, _ in self.parts for s in segs)


def mark_pieces(gm: GraphModule, ctx: PassContext) -> None:
    """Give each linear that reads a row piece of a parameter `weight_piece` / `bias_piece` and its `owner`."""
    for attr in gm.graph.nodes:
        if attr.op != "get_attr":
            continue
        t = ctx.tensors.get(attr.target)
        if not isinstance(t, nn.Parameter) or t.dim() not in (1, 2) or len(ctx.aliases(attr.target)) > 1:
            continue
        pieces = _row_pieces(attr, int(t.shape[0]))
        found = [_reader(value, t.dim()) for _, value, _ in pieces] if pieces else []
        if not found or any(f is None for f in found):
            continue
        parts = tuple(_part(reader, size) for (reader, _), (_, _, size) in zip(found, pieces))
        for i, ((reader, key), (chain, _, _)) in enumerate(zip(found, pieces)):
            spec = reader.meta["tp_rule"]
            reader.meta["tp_rule"] = RuleSpec(spec.rule, {**spec.args, key: ParamPiece(attr, chain, i, parts),
                                                          "owner": spec.get("owner") or owner_path(attr.target)})


def _row_pieces(attr: Node, rows: int) -> Optional[list[tuple[tuple[Node, ...], Node, int]]]:
    """(the ops to the piece, the piece, its rows) for each piece, in row order, when the parameter's one reader
    cuts it along dim 0 into pieces that tile it (split / chunk and their getitems, or slices), else None."""
    users = readers(attr)
    specs = [lookup(u.target) if u.op == "call_function" else None for u in users]
    if len(users) == 1 and specs[0] is not None and specs[0].rule == "split" and _dim(users[0], specs[0]) == 0:
        cut = users[0]
        got = {g.args[1]: g for g in cut.users if g.target is operator.getitem}
        sizes = [int(v.shape[0]) for v in cut.meta["val"]]
        if sorted(got) != list(range(len(sizes))) or len(got) != len(cut.users) or len(sizes) < 2:
            return None
        return [((cut, got[i]), got[i], sizes[i]) for i in range(len(sizes))]
    if len(users) < 2 or any(s is None or s.rule != "slice" for s in specs):
        return None
    runs = []
    for u in users:
        args = list(u.args) + [None] * (5 - len(u.args))
        start, end = (0 if args[2] is None else args[2]), (rows if args[3] is None else args[3])
        if (args[1] or 0) != 0 or args[4] not in (None, 1) or not (isinstance(start, int) and isinstance(end, int)):
            return None
        start, end = (min(rows, e + rows if e < 0 else e) for e in (start, end))
        runs.append((start, end, u))
    runs.sort(key=lambda r: r[:2])
    if runs[0][0] != 0 or runs[-1][1] != rows or any(a[1] != b[0] for a, b in zip(runs, runs[1:])):
        return None
    return [((u,), u, end - start) for start, end, u in runs]


def _dim(node: Node, spec: RuleSpec) -> int:
    i = spec.get("dim_arg")
    dim = node.args[i] if i is not None and i < len(node.args) else node.kwargs.get("dim", spec.get("default_dim", 0))
    return dim % node.args[0].meta["val"].dim()


def _reader(piece: Node, ndim: int) -> Optional[tuple[Node, str]]:
    """(the linear, 'weight_piece' or 'bias_piece') when the piece's one reader is F.linear using it so."""
    users = readers(piece)
    if len(users) != 1 or users[0].target is not torch.ops.aten.linear.default:
        return None
    linear = users[0]
    spec = linear.meta.get("tp_rule")
    if spec is None or spec.rule != "weight_matmul":
        return None
    key = {1: "weight_piece", 2: "bias_piece"}
    slot = next((i for i in (1, 2) if i < len(linear.args) and linear.args[i] is piece), None)
    if slot is None or (slot == 1) != (ndim == 2) or linear.args[0] is piece:
        return None
    return linear, key[slot]


def _part(linear: Node, size: int) -> Part:
    """A piece's segments (its linear's fused q|k|v layout, or one segment) and their head sizes."""
    spec = linear.meta["tp_rule"]
    segments = spec.get("segments")
    if not segments or sum(segments) != size:
        return (size,), (spec.get("heads") if not segments else None)
    return tuple(segments), spec.get("heads")
