"""Bucketing pass: per-parameter gradient syncs become one all-reduce per bucket, in backward order.

The rewriter syncs some gradients one parameter at a time: `grad_all_reduce(w)` for a
replicated parameter applied to split values (norm weights and row biases under sequence
parallelism, or a value computed from them alone, such as Gemma's `1 + weight`),
`grad_piece_all_reduce(w, ...)` for a parameter cut into fewer pieces than ranks (kv heads).
Each is one backward all-reduce, so their number grows with the parameters.

This pass collects those whose input derives from parameters alone, orders them as backward
produces their gradients (reverse graph order), and fills buckets of at most `bucket_bytes`
(by the bytes each contributes to the sum) per dtype. Each bucket becomes one
`grad_bucket_all_reduce` node, placed just before its first member (the parameters it reads
are moved up with it), whose outputs replace the members. Its backward runs once all the
bucket's gradients exist, as soon as the earliest-used parameter's has been computed.

The bucket node gets `node.meta['tp_bucket']`: (bucket index, bytes, the member parameter
names); `tp_shape` is the flattened length, which the per-rank verifier compares.
"""
from __future__ import annotations

import operator
from typing import Optional, Union

import torch
from torch import fx
from torch.fx import GraphModule, Node

import tpcompile.ops.buckets  # noqa: F401  (registers torch.ops.tpcompile.grad_bucket_all_reduce)
from tpcompile.passes.decisions import Decisions
from tpcompile.placement import Replicate, slice_shape

META_KEY = "tp_bucket"
tp = torch.ops.tpcompile


def parameters_of(x: Node) -> Optional[list[Node]]:
    """The get_attr nodes x is computed from, or None when x depends on anything else or on a random op
    (moving a dropout of a weight would change which random numbers it draws)."""
    seen, stack, params = set(), [x], []
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "get_attr":
            params.append(n)
        elif n.op != "call_function" or torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ()):
            return None
        stack.extend(n.all_input_nodes)
    return params


def _member(node: Node, plan: Decisions) -> Optional[tuple[int, int, int, torch.dtype, list[str]]]:
    """(dim, pieces, bytes, dtype, parameter names) for a per-parameter gradient sync, else None."""
    if node.op != "call_function":
        return None
    x = node.args[0]
    if node.target is tp.grad_all_reduce.default:
        dim, pieces = 0, 0
    elif node.target is tp.grad_piece_all_reduce.default:
        dim, pieces = int(node.args[1]), int(node.args[2])
    else:
        return None
    params = parameters_of(x)
    if not params or any(p.target not in plan.tensors for p in params):
        return None
    if not pieces and x.op != "get_attr":
        # a replicated value computed from parameters (Gemma's norms scale by 1 + weight): its own bytes
        val = x.meta.get("val")
        if not isinstance(val, torch.Tensor) or not isinstance(x.meta.get("tp_placement"), Replicate):
            return None
        return dim, pieces, val.numel() * val.element_size(), val.dtype, [p.target for p in params]
    nbytes = 0
    for p in params:
        t = plan.tensors[p.target]
        shape = slice_shape(t.shape, plan.slice_for(p.target), plan.world_size)
        nbytes += max(pieces, 1) * t.element_size() * int(torch.Size(shape).numel())
    return dim, pieces, nbytes, plan.tensors[params[0].target].dtype, [p.target for p in params]


def plan_buckets(members: list[tuple[Node, tuple]], bucket_bytes: int) -> list[list[tuple[Node, tuple]]]:
    """Buckets in backward order (last-used parameters first), each at most bucket_bytes per dtype."""
    buckets: list[list] = []
    open_: dict[torch.dtype, tuple[list, int]] = {}
    for node, info in reversed(members):
        dtype, nbytes = info[3], info[2]
        bucket, size = open_.get(dtype, (None, 0))
        if bucket is None or (bucket and size + nbytes > bucket_bytes):
            bucket, size = [], 0
            buckets.append(bucket)
        bucket.append((node, info))
        open_[dtype] = (bucket, size + nbytes)
    return buckets


def parameters_only(x: Node) -> bool:
    """True when x is computed from parameters (get_attr nodes) alone."""
    return bool(parameters_of(x))


def hoist(before: Node, xs: list[Node], order: dict[Node, int]) -> None:
    """Move the producers of xs that come after `before` (they read parameters only) up before it.

    One move for all of xs: `order` is the graph's order before any of them moved. Hoisting one
    value at a time with that order would move a producer they share (a split of one fused weight)
    again, after what the first move had put before it."""
    late, stack = set(), list(xs)
    while stack:
        n = stack.pop()
        if order[n] > order[before] and n not in late:
            late.add(n)
            stack.extend(n.all_input_nodes)
    for n in sorted(late, key=order.__getitem__):
        before.prepend(n)


def bucket_pass(gm: Union[GraphModule, fx.Graph], plan: Decisions,
                bucket_bytes: int) -> Union[GraphModule, fx.Graph]:
    """Replace per-parameter gradient syncs with one grad_bucket_all_reduce per bucket."""
    graph = gm.graph if isinstance(gm, GraphModule) else gm
    members = [(n, info) for n in graph.nodes if (info := _member(n, plan)) is not None]
    if not members:
        return gm
    for index, bucket in enumerate(plan_buckets(members, bucket_bytes)):
        order = {n: i for i, n in enumerate(graph.nodes)}
        bucket.sort(key=lambda m: order[m[0]])  # forward order inside the bucket
        first = bucket[0][0]
        hoist(first, [node.args[0] for node, _ in bucket[1:]], order)
        xs = [node.args[0] for node, _ in bucket]
        dims = [info[0] for _, info in bucket]
        pieces = [info[1] for _, info in bucket]
        with graph.inserting_before(first):
            fused = graph.call_function(tp.grad_bucket_all_reduce.default, (xs, dims, pieces, plan.group))
            fused.meta = {k: v for k, v in first.meta.items() if k in ("nn_module_stack", "stack_trace")}
            nbytes = sum(info[2] for _, info in bucket)
            fused.meta[META_KEY] = (index, nbytes, [name for _, info in bucket for name in info[4]])
            fused.meta["tp_shape"] = (str(nbytes // bucket[0][1][3].itemsize),)
            outs = [graph.call_function(operator.getitem, (fused, k)) for k in range(len(bucket))]
        for (node, _), out in zip(bucket, outs):
            out.meta = {k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace")}
            node.replace_all_uses_with(out)
            graph.erase_node(node)
    if isinstance(gm, GraphModule):
        gm.recompile()
    return gm
