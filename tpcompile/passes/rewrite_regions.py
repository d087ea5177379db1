"""Rewrite helper: a higher-order region on one rank, its bodies rewritten for that rank.

Each body is rewritten node by node like the rank graph (passes/rewrite.py): size literals made
local, a replicated value whose gradient is partial wrapped in `grad_all_reduce`. The rank graph's
read of the body carries the rewritten body in node.meta['tp_body'], which the rank module
(passes/rank_module.py) holds under that name. `cond` and `map_impl` become `ops/regions.run_cond` /
`run_map` (their eager meaning, safe in threads); an autocast region stays the region op, run on
this rank's body.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import fx, nn
from torch.fx import GraphModule, Node

from tpcompile.sharding_rules.regions import BODY_ARGS, body_modules
from tpcompile.ops.regions import run_cond, run_map

_RUN = {torch.ops.higher_order.cond: run_cond, torch.ops.higher_order.map_impl: run_map}


def is_region(node: Node) -> bool:
    """A higher-order region op (cond, map_impl, an autocast or grad-mode region)."""
    return node.op == "call_function" and node.target in BODY_ARGS


RewriteNode = Callable[[Any, Node], None]  # rewrite.py's _rewrite_node: one source node into an emitter's graph


def emit_region(em: Any, node: Node, lookup: Callable[[Node], Node], rewrite_node: RewriteNode) -> Node:
    """The region on this rank: its bodies rewritten (node by node with `rewrite_node`), its operands as the rule
    wants them."""
    for i, body in zip(BODY_ARGS[node.target], body_modules(em.gm, node)):
        em.env[node.args[i]].meta["tp_body"] = rank_body(em, body, rewrite_node)
    args = fx.node.map_arg(node.args, lookup)
    return em.call(_RUN.get(node.target, node.target), *args)


def rank_body(em: Any, body: GraphModule, rewrite_node: RewriteNode) -> GraphModule:
    """The body as rank em.rank runs it (its nested regions rewritten too), built by an emitter like em's."""
    sub = type(em)(body, em.plan, em.rank)
    for bn in body.graph.nodes:
        if bn.op == "output":  # the body's results as they are: the region's placements are theirs
            sub.graph.output(fx.node.map_arg(bn.args[0], lambda n: sub.env[n]))
            break
        sub.current = bn
        rewrite_node(sub, bn)
        if bn in sub.env:
            sub.sources[sub.env[bn]] = bn
    root = nn.Module()
    for n in sub.graph.nodes:
        if n.op == "get_attr":
            value = n.meta.get("tp_body")
            if value is None:
                value = body
                for part in n.target.split("."):
                    value = getattr(value, part)
            _put(root, n.target, value)
    return GraphModule(root, sub.graph, class_name="RegionBody")


def _put(root: nn.Module, name: str, value: Any) -> None:
    *path, leaf = name.split(".")
    for p in path:
        if not hasattr(root, p):
            root.add_module(p, nn.Module())
        root = getattr(root, p)
    setattr(root, leaf, value)
