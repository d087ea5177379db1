"""Rules registered beside their functions.

    @rule("reshape", args={"shape_arg": int, "sizes_arg": int, "dim_arg": int})
    def reshape(node, spec, ctx) -> Result: ...

declares a rule by name and the fields its rows in ops.yaml may carry: `int` for an argument
position of the aten op, `str` for a keyword name, a tuple of words for a choice. A rule
registered with `listed=True` takes no fields, and ops.yaml may list ops under its name
(`pointwise: [aten.add.Tensor, ...]`). The schema (schema.py) checks every row against these
declarations; propagation runs a node's rule through `apply_rule`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch.fx import Node

Rule = Callable[..., Any]  # (node, spec: RuleSpec, ctx: RuleContext) -> Result
FieldType = Any  # int | str | tuple[str, ...]


@dataclass(frozen=True)
class RuleDef:
    """A registered rule: its function and the fields an ops.yaml row naming it may carry."""

    name: str
    fn: Rule
    args: dict[str, FieldType] = field(default_factory=dict)
    listed: bool = False  # ops.yaml lists ops under this rule's name


RULES: dict[str, RuleDef] = {}


def rule(name: str, *, args: dict[str, FieldType] | None = None, listed: bool = False) -> Callable[[Rule], Rule]:
    """Register the decorated function as the rule `name`, with the row fields it reads."""
    def register(fn: Rule) -> Rule:
        assert name not in RULES, f"rule {name!r} registered twice ({RULES.get(name)})"
        RULES[name] = RuleDef(name, fn, dict(args or {}), listed)
        return fn
    return register


def apply_rule(node: Node, spec: Any, ctx: Any) -> Any:
    """Run the rule a table row names on one node."""
    return RULES[spec.rule].fn(node, spec, ctx)
