"""Annotate pass: look up each op's sharding rule and find fused projections' segments."""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx import GraphModule, Node

from tpcompile.passes.context import PassContext
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
        node.meta["tp_rule"] = spec
    return gm


def _last_dim(node: Node) -> Optional[int]:
    val = node.meta.get("val")
    return int(val.shape[-1]) if isinstance(val, torch.Tensor) and val.dim() and isinstance(val.shape[-1], int) else None


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
        if len(users) != 1:
            return None
        nxt = users[0]
        spec = lookup(nxt.target)
        if spec is None or spec.rule not in _FOLLOW or _last_dim(nxt) != width:
            return None
        cur = nxt
    return None
