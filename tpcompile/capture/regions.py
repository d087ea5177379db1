"""Higher-order regions after capture: grad-mode and no-op autocast regions inlined, every other body its own.

torch.export keeps a `torch.set_grad_enabled` / `torch.no_grad` region as
`higher_order.wrap_with_set_grad_enabled(mode, body, *operands)` and a `torch.autocast` region as
`higher_order.wrap_with_autocast(device, dtype, enabled, cache, body, *operands)`, each body a
GraphModule attribute. Inlining is exact for these (docs/architecture.md, "Higher-order regions"):

- a grad-off region is its body on detached operands: nothing computed from them carries a
  gradient, as under no_grad, and in-place writes still reach the same storage (detach shares it);
  an operand the body returns unchanged is returned as itself, as the region does, and so is one returned
  through an op that gives back its input when it changes nothing (`_same_tensor`: a cast to its own dtype);
- a grad-on region is its body as is: the values are the same; only a caller running the ranks
  under no_grad would see its outputs without a gradient, where the original's would carry one;
- an autocast region whose setting is the one the graph runs under (the rank graphs refuse any
  other autocast state than the capture's, ops/guards.InputGuard) changes nothing: a rotary
  embedding under `autocast(enabled=False)` in a model captured without autocast.

An autocast region that changes the state stays a region (its ops must run under that state),
as do `cond` and `map_impl`; each of their bodies is made this node's own (a body shared by two
calls is copied) and its nodes carry the region's module stack, so that propagation can write
placements into them (sharding_rules/regions.py, passes/region_bodies.py).
"""
from __future__ import annotations

import copy
import operator
from typing import Any

import torch
from torch import fx

from tpcompile.sharding_rules.regions import AUTOCAST_REGION, BODY_ARGS, GRAD_REGION



def inline_regions(gm: fx.GraphModule, autocast: tuple) -> fx.GraphModule:
    """Inline every grad-mode region and every autocast region that sets the state `autocast` already is
    (ops/guards.autocast_state at capture), nested ones too; give the other regions' bodies to one node each."""
    if not any(n.op == "call_function" and n.target in BODY_ARGS for n in gm.graph.nodes):
        return gm  # the common case: nothing to do, the graph untouched
    _inline_all(gm, autocast)
    return gm


def _inline_all(gm: fx.GraphModule, autocast: tuple) -> None:
    """Inline what is exact in gm, then do the same inside the regions that stay (under their autocast state)."""
    changed = True
    while changed:  # an inlined body may hold regions of its own
        changed = False
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and _inlinable(node, autocast):
                _inline(gm, node)
                changed = True
    _own_bodies(gm, autocast)
    gm.recompile()


def _inlinable(node: fx.Node, autocast: tuple) -> bool:
    if node.target is GRAD_REGION:
        return True
    if node.target is not AUTOCAST_REGION:
        return False
    device, dtype, enabled = node.args[0], node.args[1], bool(node.args[2])
    state = dict(autocast)
    if not enabled:
        return device not in state
    return state.get(device) == (dtype if dtype is not None else torch.get_autocast_dtype(device))


def _inside(node: fx.Node, autocast: tuple) -> tuple:
    """The autocast state a region's body runs under."""
    if node.target is not AUTOCAST_REGION:
        return autocast
    device, dtype, enabled = node.args[0], node.args[1], bool(node.args[2])
    state = {d: t for d, t in autocast if d != device}
    if enabled:
        state[device] = dtype if dtype is not None else torch.get_autocast_dtype(device)
    return tuple(state.items())


def _inline(gm: fx.GraphModule, node: fx.Node) -> None:
    """Replace the region node (and its getitems) by its body's nodes."""
    at = BODY_ARGS[node.target][0]
    body = _attr(gm, node.args[at].target)
    operands = list(node.args[at + 1:])
    grad_off = node.target is GRAD_REGION and not node.args[0]
    stack = node.meta.get("nn_module_stack")
    env: dict[fx.Node, Any] = {}
    outputs: list = []
    with gm.graph.inserting_before(node):
        places = [n for n in body.graph.nodes if n.op == "placeholder"]
        for ph, value in zip(places, operands):
            env[ph] = value
            if grad_off and isinstance(value, fx.Node) and isinstance(value.meta.get("val"), torch.Tensor):
                d = gm.graph.call_function(torch.ops.aten.detach.default, (value,))
                d.meta = {k: v for k, v in value.meta.items() if k in ("val", "tensor_meta")}
                d.meta["nn_module_stack"] = stack
                env[ph] = d
        for bn in body.graph.nodes:
            if bn.op == "placeholder":
                continue
            if bn.op == "output":
                outputs = list(bn.args[0]) if isinstance(bn.args[0], (list, tuple)) else [bn.args[0]]
                break
            if bn.op == "get_attr":  # a nested region's body, or a constant: moved onto the parent
                env[bn] = gm.graph.get_attr(_adopt(gm, _attr(body, bn.target), bn.target))
                env[bn].meta = dict(bn.meta)
                continue
            new = gm.graph.node_copy(bn, lambda n: env[n])
            if stack is not None and "nn_module_stack" not in new.meta:
                new.meta["nn_module_stack"] = stack
            env[bn] = new
    places = {ph: op for ph, op in zip([n for n in body.graph.nodes if n.op == "placeholder"], operands)}
    results = [places.get(_same_tensor(o), env.get(o, o)) if isinstance(o, fx.Node) else o for o in outputs]
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int):
            user.replace_all_uses_with(results[user.args[1]])
            gm.graph.erase_node(user)
    if node.users:  # the tuple itself read (returned whole): a tuple of the results
        with gm.graph.inserting_before(node):
            whole = gm.graph.call_function(tuple, (tuple(results),))
        node.replace_all_uses_with(whole)
    holder = node.args[at]
    gm.graph.erase_node(node)
    if not holder.users:  # the body's attribute read: gone with the region, and the body with it
        gm.graph.erase_node(holder)
        if not any(n.op == "get_attr" and n.target == holder.target for n in gm.graph.nodes):
            gm.delete_submodule(holder.target)


# ops that give back their input tensor itself when they change nothing (Tensor.to / .float() to its own dtype and
# device, .contiguous() of a contiguous tensor): under no_grad that is still the input, gradient and all
_SELF_WHEN_UNCHANGED = {torch.ops.aten.to.dtype, torch.ops.aten.to.device, torch.ops.aten.to.dtype_layout,
                        torch.ops.aten.to.other, torch.ops.aten.type_as.default, torch.ops.aten.contiguous.default}


def _same_tensor(node: fx.Node) -> fx.Node:
    """The body node whose tensor `node` is at run time: through ops in _SELF_WHEN_UNCHANGED that change nothing
    (same dtype, device and layout, no copy asked for, a contiguous input for contiguous)."""
    while node.op == "call_function" and node.target in _SELF_WHEN_UNCHANGED and isinstance(node.args[0], fx.Node):
        x, out = node.args[0].meta.get("val"), node.meta.get("val")
        if not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor) or (x.dtype, x.device, x.layout) != \
                (out.dtype, out.device, out.layout) or not _no_copy(node, x):
            break
        node = node.args[0]
    return node


def _no_copy(node: fx.Node, x: torch.Tensor) -> bool:
    """True when `node` (an op of _SELF_WHEN_UNCHANGED) asks for no copy: no copy=True, no memory format the input is
    not in."""
    names = [a.name for a in node.target._schema.arguments]
    args = {**dict(zip(names, node.args)), **node.kwargs}
    if args.get("copy"):
        return False
    fmt = args.get("memory_format")
    if node.target is torch.ops.aten.contiguous.default:
        fmt = fmt or torch.contiguous_format
    if fmt in (None, torch.preserve_format):
        return True
    try:
        return bool(x.is_contiguous(memory_format=fmt))
    except Exception:  # noqa: BLE001  a symbolic stride that cannot be decided: a copy, as before
        return False


def _own_bodies(gm: fx.GraphModule, autocast: tuple) -> None:
    """Each kept region reads bodies no other node reads, whose nodes carry the region's module stack; the regions
    inside them are inlined where exact."""
    seen: set[int] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in BODY_ARGS:
            continue
        args = list(node.args)
        for i in BODY_ARGS[node.target]:
            body = _attr(gm, args[i].target)
            if id(body) in seen or len(args[i].users) > 1:
                body = copy.deepcopy(body)
                with gm.graph.inserting_before(node):
                    args[i] = gm.graph.get_attr(_adopt(gm, body, args[i].target))
            seen.add(id(body))
            stack = node.meta.get("nn_module_stack")
            for bn in body.graph.nodes:
                if stack is not None and bn.op == "call_function" and "nn_module_stack" not in bn.meta:
                    bn.meta["nn_module_stack"] = stack
            _inline_all(body, _inside(node, autocast))  # nested regions inside the body
        node.args = tuple(args)


def _adopt(gm: fx.GraphModule, value: Any, name: str) -> str:
    """Register `value` (a body module or a constant) on gm under a fresh name based on `name`."""
    base = name.replace(".", "_")
    fresh, k = base, 0
    while hasattr(gm, fresh):
        k += 1
        fresh = f"{base}_{k}"
    if isinstance(value, torch.nn.Module):
        gm.add_module(fresh, value)
    else:
        setattr(gm, fresh, value)
    return fresh


def _attr(root: Any, target: str) -> Any:
    for part in target.split("."):
        root = getattr(root, part)
    return root


