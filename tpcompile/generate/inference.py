"""A rank graph trimmed for the generate loop: the same arithmetic and collectives, less work per call.

The rank graph of `ShardedModel.rank(r)` checks every call (export's guards, the input guard,
dtype asserts) and carries what training needs (gradient markers, collectives as autograd-aware
custom ops). The generate loop calls it once per token with inputs it builds itself, under
no_grad, so each of those costs a Python dispatch per step for nothing. `inference_module` copies
the graph (the copy shares every parameter and buffer with the rank graph, the cache included),
removes them, and calls the collectives' implementation directly: they still run through the
rank's backend and are still recorded (`tpcompile.ops.collectives.record`).
"""
from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch.fx import Graph, GraphModule, Node

from tpcompile.ops.collectives import _run
from tpcompile.ops.inplace import _sum_into

# identity in forward, they communicate only in backward, which generation never runs
_GRADIENT_MARKERS = ("tpcompile::grad_all_reduce",)
_CHECKS = (torch.ops.aten._assert_tensor_metadata.default,)


def _all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """torch.ops.tpcompile.all_reduce without the custom-op dispatch (no autograd in generation)."""
    return _run("all_reduce", x, group, lambda b: b.all_reduce(x))


def _all_gather_replicated(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    """torch.ops.tpcompile.all_gather_replicated without the custom-op dispatch."""
    d = dim % x.dim()
    return _run("all_gather_replicated", x, group, lambda b: b.all_gather(x, d))


def _all_reduce_inplace(x: torch.Tensor, group: str) -> torch.Tensor:
    """torch.ops.tpcompile.all_reduce.inplace (shard()'s in-place communication pass) without the dispatch."""
    return _run("all_reduce", x, group, lambda b: _sum_into(b, x))


_DIRECT: dict[Any, Callable] = {torch.ops.tpcompile.all_reduce.default: _all_reduce,
                                torch.ops.tpcompile.all_reduce.inplace: _all_reduce_inplace,
                                torch.ops.tpcompile.all_gather_replicated.default: _all_gather_replicated}


def _op_name(node: Node) -> str:
    return node.target.name() if hasattr(node.target, "name") else ""


def _same_dtype(node: Node) -> bool:
    """A cast whose input already has the target dtype (it returns its input)."""
    src = node.args[0]
    val, before = node.meta.get("val"), getattr(src, "meta", {}).get("val")
    return (len(node.args) == 2 and not node.kwargs and isinstance(val, torch.Tensor)
            and isinstance(before, torch.Tensor) and val.dtype == before.dtype == node.args[1])


def _times_one(node: Node) -> bool:
    """x * 1.0 for a floating x of the result's dtype (the same values)."""
    src = node.args[0]
    val, before = node.meta.get("val"), getattr(src, "meta", {}).get("val")
    return (len(node.args) == 2 and node.args[1] == 1.0 and type(node.args[1]) is float and not node.kwargs
            and isinstance(val, torch.Tensor) and isinstance(before, torch.Tensor) and before.is_floating_point()
            and val.dtype == before.dtype and tuple(val.shape) == tuple(before.shape))


def _copy(module: GraphModule) -> GraphModule:
    """A GraphModule running a copy of module's graph on module's own parameters and buffers."""
    graph = Graph()
    graph._codegen = copy.copy(module.graph._codegen)
    graph.output(graph.graph_copy(module.graph, {}))
    return GraphModule(module, graph, class_name=type(module).__name__)


def inference_module(module: GraphModule) -> GraphModule:
    """module's graph without checks, gradient markers and no-op casts; collectives called directly."""
    out = _copy(module)
    graph = out.graph
    for node in list(graph.nodes):
        if node.op == "call_module" and not node.users:  # the input guard and export's guards
            graph.erase_node(node)
        elif node.op != "call_function":
            continue
        elif node.target in _CHECKS:
            graph.erase_node(node)
        elif _op_name(node) in _GRADIENT_MARKERS or (
                node.target is torch.ops.aten.to.dtype and _same_dtype(node)) or (
                node.target is torch.ops.aten.mul.Tensor and _times_one(node)):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
        elif node.target in _DIRECT:
            node.target = _DIRECT[node.target]
    out.delete_all_unused_submodules()
    out.recompile()
    return out
