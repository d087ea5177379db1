"""The rule functions named in ops.yaml, by name."""
from __future__ import annotations

from typing import Callable

from torch.fx import Node

from tpcompile.sharding_rules import elementwise, matmul, shape
from tpcompile.sharding_rules.context import Result, RuleContext
from tpcompile.sharding_rules.table import RuleSpec

Rule = Callable[[Node, RuleSpec, RuleContext], Result]

RULES: dict[str, Rule] = {
    "weight_matmul": matmul.weight_matmul,
    "matmul": matmul.activation_matmul,
    "embedding": matmul.embedding,
    "sdpa": matmul.sdpa,
    "einsum": matmul.einsum,
    "reshape": shape.reshape,
    "expand": shape.expand,
    "transpose": shape.transpose,
    "permute": shape.permute,
    "split": shape.split,
    "unbind": shape.unbind,
    "cat": shape.cat,
    "slice": shape.slice_,
    "select": shape.select,
    "pointwise": elementwise.pointwise,
    "along_dim": elementwise.along_dim,
    "reduce": elementwise.reduce,
    "norm": elementwise.norm,
    "no_output": elementwise.no_output,
}


def apply_rule(node: Node, spec: RuleSpec, ctx: RuleContext) -> Result:
    """Run the rule a table row names on one node."""
    return RULES[spec.rule](node, spec, ctx)
