"""Asynchronous collectives pass: an in-place all-reduce is split into a start and a wait.

For every `all_reduce.inplace` (the in-place pass has proven its input a dead temporary), the
node becomes `all_reduce.start`, moved right after the op that computes its input (as early as
the data allows), and a `tpcompile_async.wait` is inserted right before the first node that
reads the sum; every reader then reads the wait. That first reader, when it is a pure aten op,
is first moved down to just before its own first reader (`x + a + b` computes `x + a` before
`b`; moved, `x + a` waits until `b` is done), so the wait comes as late as the data allows. What the graph
computes between the two runs while the sum is in flight: in a parallel block (attention and
MLP from the same input, summed at the end) the attention's all-reduce overlaps the MLP.

The start gets `node.meta['tp_async']`: the number of graph nodes between start and wait
(0: nothing to overlap).
"""
from __future__ import annotations

from typing import Union

import torch
from torch import fx
from torch.fx import GraphModule

import tpcompile.ops.async_ops  # noqa: F401  (registers all_reduce.start and tpcompile_async.wait)

META_KEY = "tp_async"


def _pure(node: fx.Node) -> bool:
    """An aten op that writes nothing and draws no random numbers: moving it later changes no value."""
    schema = getattr(node.target, "_schema", None)
    return (node.op == "call_function" and getattr(node.target, "namespace", None) == "aten"
            and schema is not None and not schema.is_mutable
            and torch.Tag.nondeterministic_seeded not in node.target.tags)


def _sink(node: fx.Node, depth: int = 8) -> None:
    """Move a pure node down to just before its first reader (or the output), that reader first.

    A chain of pure readers (`+ bias`, `x + ...`) moves as a whole, down to where a reader
    needs something computed later; `depth` bounds the chain.
    """
    if not _pure(node) or depth == 0:
        return
    reader = _first_reader(node)
    if reader.op != "output" and len(node.users) == 1:
        _sink(reader, depth - 1)
    at = node.next  # where the first reader is now
    while at.op != "output" and at not in node.users:
        at = at.next
    if at is not node.next:
        at.prepend(node)


def _first_reader(node: fx.Node) -> fx.Node:
    """The first node after `node` that reads it, or the output when nothing after it does (an assertion
    that nothing reads: the walk stops there rather than going round the graph's circular node list)."""
    at = node.next
    while at.op != "output" and at not in node.users:
        at = at.next
    return at


def async_pass(gm: Union[GraphModule, fx.Graph]) -> Union[GraphModule, fx.Graph]:
    """Split each all_reduce.inplace into all_reduce.start after its input and a wait before its first reader."""
    graph = gm.graph if isinstance(gm, GraphModule) else gm
    starts = [n for n in graph.nodes if n.op == "call_function" and n.target is torch.ops.tpcompile.all_reduce.inplace]
    for node in starts:
        x = node.args[0]
        x.append(node)  # start as soon as the input exists
        node.target = torch.ops.tpcompile.all_reduce.start
        _sink(_first_reader(node))
        first = _first_reader(node)
        with graph.inserting_before(first):
            done = graph.call_function(torch.ops.tpcompile_async.wait.default, (node,))
        done.meta = {k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace")}
        node.replace_all_uses_with(done, delete_user_cb=lambda user, done=done: user is not done)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in starts:
        (done,) = node.users
        node.meta[META_KEY] = order[done] - order[node] - 1
    if starts and isinstance(gm, GraphModule):
        gm.recompile()
    return gm
