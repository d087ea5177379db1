"""Mixed precision in a rank graph: float32 master weights, compute in the graph's dtype, gradient syncs in float32.

The graph was captured with its parameters in the compute dtype (capture/precision.py), so every op
after a parameter read expects that dtype; the rank module's parameters are float32 masters. This
pass puts one cast after each floating parameter read, `aten.to.dtype(p, compute)`, whose backward
casts the gradient back to float32 for the master. A parameter whose gradient is summed across ranks
in the graph (grad_all_reduce, grad_piece_all_reduce, or a gradient bucket: a replicated weight applied
to split values) gets its cast after that sync instead, with a cast to float32 before it, so the sum
runs in float32 whatever dtype the parameter arrives in (float32 masters here, or bfloat16 when FSDP2
gathers it in its param_dtype; a cast to the dtype a tensor already has is no op).
"""
from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from tpcompile.ops.schedule import collective_op

__all__ = ["GRADIENT_SYNCS", "mixed_precision_pass"]

GRADIENT_SYNCS = frozenset({"grad_all_reduce", "grad_piece_all_reduce", "grad_bucket_all_reduce"})
_to = torch.ops.aten.to.dtype


def _is_float_parameter(gm: GraphModule, node: Node) -> bool:
    """A get_attr of a floating nn.Parameter."""
    if node.op != "get_attr":
        return False
    obj = gm
    for part in node.target.split("."):
        obj = getattr(obj, part, None)
    return isinstance(obj, torch.nn.Parameter) and obj.is_floating_point()


def _cast(gm: GraphModule, value: Node, dtype: torch.dtype, *, after: Node) -> Node:
    """A new node casting `value` to dtype, placed after `after`, with value's metadata (dtype changed)."""
    with gm.graph.inserting_after(after):
        node = gm.graph.call_function(_to, (value, dtype))
    val = value.meta.get("val")
    node.meta = {k: v for k, v in value.meta.items() if k in ("nn_module_stack", "stack_trace")}
    if isinstance(val, torch.Tensor):
        node.meta["val"] = val.to(dtype) if not val.is_meta else torch.empty_like(val, dtype=dtype)
    return node


def _sync_outputs(sync: Node, source: Node) -> list[Node]:
    """The nodes carrying `source` out of a gradient sync: the sync itself, or a bucket's getitems of it."""
    if collective_op(sync) != "grad_bucket_all_reduce":
        return [sync]
    position = list(sync.args[0]).index(source)
    return [u for u in sync.users if u.target is operator.getitem and u.args[1] == position]


def mixed_precision_pass(gm: GraphModule, compute: torch.dtype) -> GraphModule:
    """Cast every floating parameter read to `compute`, its gradient syncs kept in float32 (module docstring)."""
    for node in list(gm.graph.nodes):
        if not _is_float_parameter(gm, node):
            continue
        users = list(node.users)
        syncs = [u for u in users if collective_op(u) in GRADIENT_SYNCS]
        plain = [u for u in users if u not in syncs]
        if plain:
            cast = _cast(gm, node, compute, after=node)
            for u in plain:
                u.replace_input_with(node, cast)
        for sync in syncs:
            wide = _cast(gm, node, torch.float32, after=node)
            sync.replace_input_with(node, wide)
            for out in _sync_outputs(sync, wide):
                readers = list(out.users)
                cast = _cast(gm, out, compute, after=out)
                for r in readers:
                    r.replace_input_with(out, cast)
    gm.graph.lint()
    gm.recompile()
    return gm
