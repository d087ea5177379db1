"""Sharding rules: the op table (ops.yaml: aten op -> rule name and fields) and the rule functions,
each registered beside its definition with @rule (registry.py)."""
from tpcompile.sharding_rules import (  # noqa: F401  (registers the rules)
    conv, einsum, elementwise, experts, join, layout_ops, matmul, reductions, regions, shape, slicing, state, view_as)
from tpcompile.sharding_rules.table import RuleSpec, load_table, lookup, op_name

__all__ = ["RuleSpec", "load_table", "lookup", "op_name"]
