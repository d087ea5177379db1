"""Sharding rules: the op table (ops.yaml) and the functions it names (rules.py)."""
from tpcompile.sharding_rules.table import RuleSpec, load_table, lookup, op_name

__all__ = ["RuleSpec", "load_table", "lookup", "op_name"]
