"""Annotate pass: look up each op's sharding rule and find fused projections' segments."""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx import GraphModule, Node

from tpcompile.passes.pass_context import PassContext, module_path, owner_path
from tpcompile.sharding_rules import RuleSpec, lookup

_SPLITS = {"split", "unbind"}
_FOLLOW = {"pointwise", "reshape"}


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
    return gm


def _owner(node: Node, spec: RuleSpec, ctx: PassContext) -> Optional[str]:
    """The module a weight op belongs to: its weight's module, or the caller's for tied weights."""
    w = node.args[spec.get("weight", 0)]
    if not (isinstance(w, Node) and w.op == "get_attr" and w.target in ctx.tensors):
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
