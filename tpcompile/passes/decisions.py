"""The frozen plan: what propagation decided, as one immutable value that every later step reads.

Propagation works on the captured graph's `node.meta` (`tp_rule`, `tp_placement`, `tp_layout`) and a mutable
`PassContext` while it iterates. When it is done, `freeze` copies the decision out, node -> (rule, placement,
layout) for the graph and every region body, parameter or buffer -> its cut, and takes those keys off the
graph, so no later step can read a half-made or changed decision. The verifier, the Plan, the rewrite of every
rank, the communication passes and the tools behind `ShardedModel` read this value only.

`Annotations` reads the same three things from `node.meta`, for the helpers that propagation and the rewrite
share (pending sums): each is given the one or the other.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Optional

import torch
from torch.fx import GraphModule, Node

from tpcompile.passes.layout import Layout
from tpcompile.passes.pass_context import PassContext
from tpcompile.placement import ParamSlice

KEYS = ("tp_rule", "tp_placement", "tp_layout")  # the propagation's own node.meta keys, taken off by freeze


@dataclass(frozen=True)
class NodeDecision:
    """One node's op table row, output placement (a tuple for multi-output ops) and layout."""

    rule: Any = None
    placement: Any = None
    layout: Optional[Layout] = None


class Annotations:
    """The decision as propagation is writing it, read from node.meta."""

    @staticmethod
    def placement(node: Node, default: Any = None) -> Any:
        return node.meta.get("tp_placement", default)

    @staticmethod
    def layout(node: Node) -> Optional[Layout]:
        return node.meta.get("tp_layout")

    @staticmethod
    def rule(node: Node) -> Any:
        return node.meta.get("tp_rule")


ANNOTATIONS = Annotations()


@dataclass(frozen=True)
class Decisions:
    """The frozen plan of one shard() call (see the module docstring)."""

    world_size: int
    group: str
    sequence_parallel: bool
    overrides: Mapping[str, str]  # module path -> replicate | sharded_output | auto, as the user gave them
    tensors: Mapping[str, torch.Tensor]  # every name the captured graph reads -> the parameter or buffer
    cuts: Mapping[str, Optional[ParamSlice]]  # every name of `tensors` -> its cut (None: whole), aliases resolved
    names: Mapping[str, tuple[str, ...]]  # every name -> all the names of its tensor (tied parameters), in order
    seeds: Mapping[str, frozenset]  # a split parameter -> the weight ops that cut it
    nodes: Mapping[Node, NodeDecision] = field(repr=False)  # graph and region-body nodes -> their decision

    def placement(self, node: Node, default: Any = None) -> Any:
        d = self.nodes.get(node)
        return default if d is None or d.placement is None else d.placement

    def layout(self, node: Node) -> Optional[Layout]:
        d = self.nodes.get(node)
        return None if d is None else d.layout

    def rule(self, node: Node) -> Any:
        d = self.nodes.get(node)
        return None if d is None else d.rule

    def slice_for(self, name: str) -> Optional[ParamSlice]:
        """How the parameter or buffer `name` is cut across the ranks (None: whole)."""
        return self.cuts.get(name)

    def aliases(self, name: str) -> list[str]:
        """Every name of the tensor called `name` (tied parameters have several), itself included."""
        return list(self.names.get(name, (name,)))


def freeze(gm: GraphModule, ctx: PassContext) -> Decisions:
    """The decision propagation left on `gm` (and its region bodies) and in `ctx`, as a frozen value; the
    propagation's keys are taken off the nodes."""
    nodes: dict[Node, NodeDecision] = {}
    for module in gm.modules():
        if not isinstance(module, GraphModule):
            continue
        for node in module.graph.nodes:
            rule, placement, layout = (node.meta.pop(k, None) for k in KEYS)
            if rule is not None or placement is not None or layout is not None:
                nodes[node] = NodeDecision(rule, placement, _frozen(layout))
    names = {n: tuple(ctx.aliases(n)) for n in ctx.tensors}
    return Decisions(
        world_size=ctx.world_size, group=ctx.group, sequence_parallel=ctx.sequence_parallel,
        overrides=MappingProxyType(dict(ctx.overrides)), tensors=MappingProxyType(dict(ctx.tensors)),
        cuts=MappingProxyType({n: ctx.slice_for(n) for n in ctx.tensors}), names=MappingProxyType(names),
        seeds=MappingProxyType({n: frozenset(s) for n, s in ctx.param_seeds.items()}),
        nodes=MappingProxyType(nodes))


def _frozen(layout: Optional[Layout]) -> Optional[Layout]:
    """A layout whose lists are tuples."""
    if layout is None:
        return None
    return Layout(layout.role, tuple(layout.wants), None if layout.localize is None else tuple(layout.localize),
                  layout.gather_output)
