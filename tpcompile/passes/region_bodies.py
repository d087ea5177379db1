"""A higher-order region's body placed node by node, with the propagation's own step (sharding_rules/regions.py
asks for it through RuleContext.place_body).

Each body node gets its op table row, and the rule's answer is taken only when it needs no
communication inside the body: its inputs as the op wants them (a replicated input whose
gradient is partial is fine: the rewrite sums that gradient inside the body), no weight op, no
reduction from partial statistics. A node that wants a whole placeholder split asks the region
to cut that operand first (no communication either).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

import torch
from torch.fx import GraphModule, Node

from tpcompile.passes.layout import Layout
from tpcompile.passes.op_result import check_wants, op_result
from tpcompile.placement import REPLICATE, Replicate, Shard
from tpcompile.sharding_rules.conform import conformed
from tpcompile.sharding_rules.partial import partial_result
from tpcompile.sharding_rules.rule_context import Result, RuleContext
from tpcompile.sharding_rules.table import lookup, op_name

_BODY_ROLES = ("generic", "replicated")  # roles a body op may take: the op itself on each rank's values


def place_body(body: GraphModule, inputs: list, grads: list[bool], ctx: RuleContext) -> tuple:
    """Write tp_rule, tp_placement and tp_layout on every node of a body whose placeholders are placed `inputs`.

    Returns (the outputs' placements, None, None); (None, why, None) when a node needs communication inside the
    body; or (None, None, (k, placement)) when a node wants whole placeholder k split (a parameter passed in,
    scaling a split value): the region then takes this rank's slice of that operand before it, no communication.
    """
    places = [n for n in body.graph.nodes if n.op == "placeholder"]
    if len(places) != len(inputs):
        return None, f"the body takes {len(places)} inputs, the region passes {len(inputs)}", None
    grad: dict[Node, bool] = {}

    def placement(n: Any) -> Any:
        return n.meta.get("tp_placement", REPLICATE) if isinstance(n, Node) else REPLICATE
    inner = replace(ctx, placement=placement, requires_grad=lambda n: grad.get(n, False), param=lambda n: None,
                    buffer=lambda n: None, is_user_input=lambda n: False, demoted=lambda n: False,
                    segment_hint=lambda n: None, pieces_of=lambda n: None, split_bytes=lambda n: 0)
    for ph, p, g in zip(places, inputs, grads):
        ph.meta["tp_placement"], ph.meta["tp_layout"], grad[ph] = p, Layout(), g
    for bn in body.graph.nodes:
        if bn.op == "output":
            flat = bn.args[0] if isinstance(bn.args[0], (list, tuple)) else (bn.args[0],)
            return tuple(placement(a) for a in flat), None, None
        if bn.op == "placeholder":
            continue
        if bn.op != "call_function":  # a nested region's body, a constant
            bn.meta["tp_placement"], bn.meta["tp_layout"] = REPLICATE, Layout()
            continue
        bn.meta["tp_rule"] = lookup(bn.target)
        grad[bn] = _float(bn) and any(grad.get(i, False) for i in bn.all_input_nodes)
        res = conformed(bn, partial_result(bn, inner, placement, op_result))
        why = res.conflict or check_wants(res, placement, ctx.world_size)[0]
        lift = None if why else _lift(res, places, placement)
        if lift is not None:
            return None, None, lift
        why = why or _communication(res, placement)
        if why is None and (res.role not in _BODY_ROLES or res.params):
            why = f"it is a {res.role} weight op"
        if why is not None:
            return None, f"{op_name(bn.target)} ({bn.name}): {why}", None
        bn.meta["tp_placement"], bn.meta["tp_layout"] = res.out, Layout(res.role, res.wants, res.localize)
    return None, "the body has no output", None


def _lift(res: Result, places: list[Node], placement: Any) -> Optional[tuple[int, Shard]]:
    """(k, placement) for the first whole placeholder k that the op wants plainly split, else None."""
    for w in res.wants:
        if w.node in places and isinstance(placement(w.node), Replicate) and isinstance(w.placement, Shard) \
                and w.placement.plain and not w.placement.seq:
            return places.index(w.node), w.placement
    return None


def _communication(res: Result, placement: Any) -> Optional[str]:
    """Why an input must be redistributed before the op (a collective inside the body), or None."""
    for w in res.wants:
        have = placement(w.node)
        if have != w.placement:
            return f"input {w.node.name} is {have} but the op needs {w.placement} (a collective inside the region)"
    return None


def _float(node: Node) -> bool:
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    return any(isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()) for v in vals)
