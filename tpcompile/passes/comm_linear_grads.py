"""Input-gradient overlap pass: the linears reading one `grad_all_reduce(x)` become one
`linears_grad_all_reduce([x, *weights, *biases], has_bias)`, whose backward overlaps x's gradient all-reduce
with the weight gradients (Megatron's asynchronous input-gradient all-reduce).

`grad_all_reduce(x)` marks a replicated value entering column splits: in backward, the
gradients of every reader are summed, then all-reduced, and nothing else runs meanwhile, since
each linear's backward computes its input and weight gradients together. Fused, the backward
computes the input gradient of all the linears, launches its all-reduce, computes the weight
and bias gradients, then waits. Applies when every reader of the grad_all_reduce is
`aten.linear(x, w[, b])` with x as input and w, b read from parameters only; the fused node sits
where the first linear was (the weights it reads are moved up with it). The fused node gets
`node.meta['tp_overlap']`: the number of linears it holds.
"""
from __future__ import annotations

import operator
from typing import Union

import torch
from torch import fx
from torch.fx import GraphModule, Node

import tpcompile.ops.linear_grads  # noqa: F401  (registers torch.ops.tpcompile.linears_grad_all_reduce)
from tpcompile.passes.comm_bucket import hoist, parameters_only

META_KEY = "tp_overlap"
aten = torch.ops.aten


def _fusable(node: Node) -> bool:
    """A grad_all_reduce of an activation whose readers are all linears of parameters taking it as input."""
    if node.op != "call_function" or node.target is not torch.ops.tpcompile.grad_all_reduce.default:
        return False
    if node.args[0].op == "get_attr" or not node.users:
        return False
    for user in node.users:
        if user.target is not aten.linear.default or user.kwargs or user.args[0] is not node:
            return False
        if not all(a is None or (isinstance(a, Node) and a is not node and parameters_only(a)) for a in user.args[1:]):
            return False
    return True


def linear_grads_pass(gm: Union[GraphModule, fx.Graph]) -> Union[GraphModule, fx.Graph]:
    """Fuse each grad_all_reduce and the linears reading it into one linears_grad_all_reduce."""
    graph = gm.graph if isinstance(gm, GraphModule) else gm
    targets = [n for n in graph.nodes if _fusable(n)]
    for g in targets:
        order = {n: i for i, n in enumerate(graph.nodes)}
        linears = sorted(g.users, key=order.__getitem__)
        first = linears[0]
        hoist(first, [a for lin in linears[1:] for a in lin.args[1:] if a is not None], order)
        weights = [lin.args[1] for lin in linears]
        biases = [lin.args[2] if len(lin.args) > 2 else None for lin in linears]
        tensors = [g.args[0], *weights, *(b for b in biases if b is not None)]
        with graph.inserting_before(first):
            fused = graph.call_function(torch.ops.tpcompile.linears_grad_all_reduce.default,
                                        (tensors, [int(b is not None) for b in biases], g.args[1]))
            outs = [graph.call_function(operator.getitem, (fused, k)) for k in range(len(linears))]
        fused.meta = {k: v for k, v in g.meta.items() if k in ("nn_module_stack", "stack_trace", "tp_shape")}
        fused.meta[META_KEY] = len(linears)
        for lin, out in zip(linears, outs):
            out.meta = {k: v for k, v in lin.meta.items() if k in ("nn_module_stack", "stack_trace")}
            lin.replace_all_uses_with(out)
            graph.erase_node(lin)
        graph.erase_node(g)
    if targets and isinstance(gm, GraphModule):
        gm.recompile()
    return gm
