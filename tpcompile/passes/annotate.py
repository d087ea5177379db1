"""Annotate pass: look up each op's sharding rule and find fused projections' segments."""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx import GraphModule, Node

from tpcompile.passes.pass_context import PassContext, module_path, owner_path
from tpcompile.sharding_rules import RuleSpec, lookup
from tpcompile.sharding_rules.rule_context import weight_view

_SPLITS = {"split", "unbind"}
_FOLLOW = {"pointwise", "reshape"}
_THROUGH = {"pointwise", "reshape", "norm"}  # what lies between a low-rank pair's two projections


def annotate_pass(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Write node.meta['tp_rule'] (the op table row, None when the op has none) on every op."""
    ctx.tensors = dict(gm.named_parameters(remove_duplicate=False))
    ctx.tensors.update(dict(gm.named_buffers(remove_duplicate=False)))
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        spec = lookup(node.target)
        if spec is not None and spec.rule == "weight_matmul":
            segments = _segment_hint(node)
            if segments:
                spec = RuleSpec(spec.rule, {**spec.args, "segments": segments})
        if spec is not None and spec.rule in ("weight_matmul", "embedding"):
            spec = RuleSpec(spec.rule, {**spec.args, "owner": _owner(node, spec, ctx)})
        node.meta["tp_rule"] = spec
    for down, up in _low_rank_pairs(gm, ctx):
        down.meta["tp_rule"] = RuleSpec("weight_matmul", {**down.meta["tp_rule"].args, "low_rank": "down"})
        up.meta["tp_rule"] = RuleSpec("weight_matmul", {**up.meta["tp_rule"].args, "low_rank_from": down})
    return gm


def _weight_sizes(node: Node, ctx: PassContext) -> Optional[tuple[int, int]]:
    """(in, out) features of a weight matmul with a 2-D parameter weight, else None."""
    spec = node.meta.get("tp_rule")
    if spec is None or spec.rule != "weight_matmul":
        return None
    w, transposed = weight_view(node.args[spec.get("weight")] if spec.get("weight") < len(node.args) else None)
    if w is None or w.target not in ctx.tensors or ctx.tensors[w.target].dim() != 2:
        return None
    rows, cols = ctx.tensors[w.target].shape
    out_in = (spec.get("weight_layout") == "out_in") != transposed
    return (int(cols), int(rows)) if out_in else (int(rows), int(cols))


def _low_rank_pairs(gm: GraphModule, ctx: PassContext) -> list[tuple[Node, Node]]:
    """(down, up) projections through a narrow value: out <= in/8, and everything computed from that value
    (dropout, scaling, a norm, a reshape; nothing else mixed in) flows into one weight matmul that widens it
    again (LoRA A -> B, MLA's q_a -> q_b). A value that also goes elsewhere or meets another activation (a
    residual stream) makes no pair.

    Megatron and vLLM keep such a down-projection whole on every rank and split the up-projection,
    which needs no communication; propagation does the same when the down-projection's input is whole.
    """
    pairs = []
    for node in gm.graph.nodes:
        sizes = _weight_sizes(node, ctx)
        if sizes is None or sizes[1] * 8 > sizes[0]:
            continue
        ends, region, todo = set(), {node}, list(node.users)
        while todo and len(region) < 32:
            u = todo.pop()
            if u in region or u in ends:
                continue
            spec = u.meta.get("tp_rule")
            if _weight_sizes(u, ctx) is not None:
                ends.add(u)
            elif u.op == "call_function" and spec is not None and spec.rule in _THROUGH and all(
                    i in region or i.op == "get_attr" for i in u.all_input_nodes):  # nothing else mixed in
                region.add(u)
                todo += list(u.users)
            else:
                ends.add(None)  # the value escapes the chain
        up = next(iter(ends)) if len(ends) == 1 and not todo else None
        if up is not None and _weight_sizes(up, ctx)[0] == sizes[1]:
            pairs.append((node, up))
    return pairs


def _owner(node: Node, spec: RuleSpec, ctx: PassContext) -> Optional[str]:
    """The module a weight op belongs to: its weight's module, or the caller's for tied weights."""
    w, _ = weight_view(node.args[spec.get("weight", 0)])
    if w is None or w.target not in ctx.tensors:
        return None
    tied = len(ctx.aliases(w.target)) > 1
    return (module_path(node) if tied else "") or owner_path(w.target)


def _last_dim(node: Node) -> Optional[int]:
    val = node.meta.get("val")
    return int(val.shape[-1]) if isinstance(val, torch.Tensor) and val.dim() and isinstance(val.shape[-1], int) else None


def _stacked_segments(reshape: Node, width: int) -> Optional[tuple[int, ...]]:
    """(..., k*E) reshaped to (..., k, ...) whose k dim is then unbound: k segments of E (q|k|v)."""
    shape = [int(s) if isinstance(s, int) else None for s in reshape.meta["val"].shape]
    prod, d = 1, len(shape)
    while d > 0 and shape[d - 1] is not None and prod < width:
        d -= 1
        prod *= shape[d]
    k = shape[d] if d < len(shape) else None
    if prod != width or k is None or k <= 1 or d == len(shape) - 1 or not _unbound_later(reshape, d):
        return None
    return (width // k,) * k


def _unbound_later(node: Node, d: int) -> bool:
    """True when dim d of node, followed through transposes and permutes, is split or unbound."""
    for _ in range(6):
        users = list(node.users)
        if not users:
            return False
        for u in users:
            spec = lookup(u.target)
            if spec is not None and spec.rule in ("unbind", "split", "select"):
                i = 2 if spec.rule == "split" else 1
                dim = u.args[i] if len(u.args) > i else u.kwargs.get("dim", 0)
                if dim % u.args[0].meta["val"].dim() == d:
                    return True
        if len(users) != 1:
            return False
        u = users[0]
        if u.target is torch.ops.aten.permute.default:
            d = [x % len(u.args[1]) for x in u.args[1]].index(d)
        elif u.target is torch.ops.aten.transpose.int:
            nd = u.args[0].meta["val"].dim()
            a, b = u.args[1] % nd, u.args[2] % nd
            d = b if d == a else a if d == b else d
        elif u.target is torch.ops.aten.unsqueeze.default:
            d += u.args[1] % u.meta["val"].dim() <= d
        elif u.target is torch.ops.aten.squeeze.dim:
            d -= u.args[1] % u.args[0].meta["val"].dim() < d
        elif lookup(u.target) is None or lookup(u.target).rule != "pointwise":
            return False
        node = u
    return False


def _segment_hint(node: Node) -> Optional[tuple[int, ...]]:
    """Sizes a fused projection's output is split into along its last dim (q|k|v), if it is."""
    width, cur = _last_dim(node), node
    for _ in range(8):
        users = list(cur.users)
        for u in users:
            spec = lookup(u.target)
            vals = u.meta.get("val")
            if spec is not None and spec.rule == "split" and isinstance(vals, (list, tuple)):
                ndim = cur.meta["val"].dim()
                dim = u.args[2] if len(u.args) > 2 else u.kwargs.get("dim", 0)
                if dim % ndim == ndim - 1:
                    return tuple(int(v.shape[-1]) for v in vals)
            if spec is not None and spec.rule == "reshape" and width:
                stacked = _stacked_segments(u, width)
                if stacked:
                    return stacked
        if len(users) != 1:
            return None
        nxt = users[0]
        spec = lookup(nxt.target)
        if spec is None or spec.rule not in _FOLLOW or _last_dim(nxt) != width:
            return None
        cur = nxt
    return None
