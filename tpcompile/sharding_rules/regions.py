"""The rule for higher-order regions: `cond`, `map_impl` and autocast regions that change the state.

(capture/regions.py inlines grad-mode regions and autocast regions that change nothing, so the
ordinary machinery places them.) A kept region's operands carry their placements into its body's
placeholders (`map_impl`'s mapped operands lose their dim 0), each body node is placed by its own
rule, and the region's outputs carry the placements of the body's outputs (`map_impl`'s stacked
ones gain a dim 0). Both branches of a `cond` must agree. A body is placed only when it needs no
communication inside: every input already as its op wants it, no weight op, no reduction from
partial statistics; a replicated value whose gradient is partial (it meets a split value) gets
its gradient summed inside the body (passes/rewrite_regions.py); a whole operand that a body op
wants split (a parameter scaling a split value) is cut before the region. Anything else is a
conflict naming the region op and the body node, and the region's inputs are replicated (a
warning). Each body node is placed by passes/region_bodies.py, which propagation hands to the
rule (RuleContext.place_body).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import fx
from torch.fx import Node

from tpcompile.placement import REPLICATE, Partial, Shard, is_seq, moved
from tpcompile.sharding_rules.registry import rule
from tpcompile.sharding_rules.rule_context import Result, RuleContext, Want
from tpcompile.sharding_rules.table import RuleSpec

hop = torch.ops.higher_order
GRAD_REGION, AUTOCAST_REGION = hop.wrap_with_set_grad_enabled, hop.wrap_with_autocast
BODY_ARGS = {GRAD_REGION: (1,), AUTOCAST_REGION: (4,), hop.cond: (1, 2), hop.map_impl: (0,)}  # body positions


def body_modules(gm: fx.GraphModule, node: Node) -> list[fx.GraphModule]:
    """The body GraphModules of a region node (empty for any other node)."""
    out = []
    for i in BODY_ARGS.get(node.target, ()):
        m: Any = gm
        for part in node.args[i].target.split("."):
            m = getattr(m, part)
        out.append(m)
    return out


@rule("region", args={"kind": ("cond", "map", "wrap")})
def region(node: Node, spec: RuleSpec, ctx: RuleContext) -> Result:
    """cond / map_impl / wrap_with_autocast: the bodies placed by the ordinary rules, the outputs as theirs."""
    kind = spec.get("kind")
    operands = _operands(node, kind)
    tensors = [o for o in operands if ctx.is_tensor(o)]
    n_out = _outputs(node)
    pred = node.args[0] if kind == "cond" and isinstance(node.args[0], Node) else None
    grads = [bool(isinstance(o, Node) and ctx.requires_grad(o)) for o in operands]

    def fail(why: str) -> Result:
        # the bodies as the rewrite will see them if this stands: on whole operands (no stale split inside)
        _place_bodies(node, kind, [REPLICATE] * len(operands), grads, ctx)
        wants = [Want(t, REPLICATE) for t in tensors] + ([Want(pred, REPLICATE)] if pred is not None else [])
        return Result(tuple(REPLICATE for _ in range(n_out)), wants, conflict=why)

    if pred is not None and isinstance(ctx.placement(pred), Shard):
        return fail(f"its predicate {pred.name} is split across ranks")
    given = [_whole_if_pending(ctx.placement(o)) if isinstance(o, Node) else REPLICATE for o in operands]
    if any(is_seq(p) for p in given):
        return fail("an operand is split by tokens (sequence parallel)")
    inputs = list(given)
    if kind == "map":
        for k in range(len(node.args[1])):  # the mapped operands: each body call sees one entry of dim 0
            p = inputs[k]
            if isinstance(p, Shard) and p.dim == 0:
                return fail(f"operand {operands[k].name} is split on dim 0, the dim it maps over")
            inputs[k] = moved(p, p.dim - 1) if isinstance(p, Shard) else p
    mapped = len(node.args[1]) if kind == "map" else 0
    for _ in range(len(inputs) + 1):  # each round may cut one whole operand as the body wants it
        outs, why, lift = _place_bodies(node, kind, inputs, grads, ctx)
        if lift is None:
            break
        k, p = lift
        inputs[k] = p
        given[k] = moved(p, p.dim + 1) if k < mapped else p  # this rank's slice, taken before the region
    if why is not None or outs is None:
        return fail(why or "its body wants its operands cut more ways than it has operands")
    if kind == "map":
        outs = tuple(moved(p, p.dim + 1) if isinstance(p, Shard) else p for p in outs)
    wants = [Want(o, p) for o, p in zip(operands, given) if ctx.is_tensor(o)]
    if pred is not None:
        wants.append(Want(pred, REPLICATE))
    return Result(outs, wants)


def _place_bodies(node: Node, kind: str, inputs: list, grads: list[bool], ctx: RuleContext) -> tuple:
    """(outputs' placements, why not, an operand to cut first) over every body of the region."""
    outs: Optional[tuple] = None
    for label, body in zip(_labels(kind), body_modules(node.graph.owning_module, node)):
        got, why, lift = ctx.place_body(body, inputs, grads, ctx)
        if lift is not None:
            return None, None, lift
        if why is not None:
            return None, f"its {label} cannot be placed: {why}", None
        if outs is not None and got != outs:
            return None, f"its branches place their outputs differently ({_show(outs)} and {_show(got)})", None
        outs = got
    return outs, None, None


def _operands(node: Node, kind: str) -> list:
    """The values the region passes to its body, in the order of the body's placeholders."""
    if kind == "cond":
        return list(node.args[3])
    if kind == "map":
        return [*node.args[1], *node.args[2]]
    return list(node.args[BODY_ARGS[node.target][0] + 1:])


def _labels(kind: str) -> tuple[str, ...]:
    return ("true branch", "false branch") if kind == "cond" else ("body",)


def _outputs(node: Node) -> int:
    val = node.meta.get("val")
    return len(val) if isinstance(val, (list, tuple)) else 1


def _whole_if_pending(p: Any) -> Any:
    """A pending sum enters a region summed (one all-reduce before it)."""
    return REPLICATE if isinstance(p, Partial) else p


def _show(outs: tuple) -> str:
    return ", ".join(str(p) for p in outs)
