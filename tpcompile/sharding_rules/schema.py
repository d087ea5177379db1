"""The op table's schema: the rules registered (registry.py) and the fields each declares, checked with line numbers.

The table is read with the safe YAML loader and every row is checked here before any rule runs,
so a typo in ops.yaml (or in a user's rule file) is an error naming the key and its line instead
of a silently missing or misapplied rule.
"""
from __future__ import annotations

import re
from typing import Any

import yaml

from tpcompile.errors import TPCompileError
from tpcompile.sharding_rules.registry import RULES

_OP = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*$")  # aten.add.Tensor
_STR, _INT = "tag:yaml.org,2002:str", "tag:yaml.org,2002:int"


def parse_table(text: str, source: str) -> dict[str, tuple[str, dict[str, Any], int]]:
    """Op name -> (rule, arguments, line) from the table's YAML text; a TPCompileError names any bad row."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = "" if mark is None else f" at line {mark.line + 1}, column {mark.column + 1}"
        raise TPCompileError(f"rule file {source}: YAML syntax error{where}: {getattr(e, 'problem', e)}; rows read "
                             f"'aten.op.overload: {{rule: NAME, ...}}'") from e
    if not isinstance(root, yaml.MappingNode):
        raise TPCompileError(f"rule file {source}: the top level must be a mapping of op name -> row; see "
                             f"docs/architecture.md, 'Adding a sharding rule'")
    rows: dict[str, tuple[str, dict[str, Any], int]] = {}

    def add(op_node: Any, rule: str, args: dict[str, Any]) -> None:
        line = op_node.start_mark.line + 1
        op = op_node.value if isinstance(op_node, yaml.ScalarNode) else None
        if op is None or op_node.tag != _STR or not _OP.match(op):
            raise TPCompileError(f"rule file {source} line {line}: {op if op is not None else 'a non-text key'!r} is "
                                 f"not an op name of the form namespace.op.overload (e.g. aten.add.Tensor)")
        if op in rows:
            raise TPCompileError(f"rule file {source} line {line}: {op} already has a row at line {rows[op][2]}; "
                                 f"keep one row per op")
        rows[op] = (rule, args, line)

    for key_node, value_node in root.value:
        key, line = getattr(key_node, "value", None), key_node.start_mark.line + 1
        if key in RULES and RULES[key].listed:
            if not isinstance(value_node, yaml.SequenceNode):
                raise TPCompileError(f"rule file {source} line {line}: {key} must be a list of op names")
            for item in value_node.value:
                add(item, key, {})
        elif isinstance(value_node, yaml.MappingNode):
            add(key_node, *_row(key, value_node, source))
        else:
            raise TPCompileError(f"rule file {source} line {line}: {key}: the row must be a mapping such as "
                                 f"{{rule: pointwise}}; rules: {', '.join(sorted(RULES))}")
    return rows


def _row(op: str, node: yaml.MappingNode, source: str) -> tuple[str, dict[str, Any]]:
    """(rule, arguments) of one mapping row, each field checked against the rule's arguments."""
    fields: dict[str, Any] = {}
    for k, v in node.value:
        name, line = getattr(k, "value", None), k.start_mark.line + 1
        if name in fields:
            raise TPCompileError(f"rule file {source} line {line}: {op}: field {name!r} appears twice")
        if not isinstance(v, yaml.ScalarNode):
            raise TPCompileError(f"rule file {source} line {line}: {op}: field {name!r} must be a single value")
        fields[name] = (v, line)
    line = node.start_mark.line + 1
    if "rule" not in fields:
        raise TPCompileError(f"rule file {source} line {line}: {op} has no 'rule' field; add rule: NAME with NAME "
                             f"one of {', '.join(sorted(RULES))}")
    rule_node, _ = fields.pop("rule")
    rule = rule_node.value
    if rule not in RULES:
        raise TPCompileError(f"rule file {source} line {line}: {op}: unknown rule {rule!r}; use one of "
                             f"{', '.join(sorted(RULES))} (or list the op under pointwise)")
    args: dict[str, Any] = {}
    for name, (v, fline) in fields.items():
        if name not in RULES[rule].args:
            allowed = ", ".join(RULES[rule].args) or "none"
            raise TPCompileError(f"rule file {source} line {fline}: {op}: unknown field {name!r} for rule {rule}; "
                                 f"its fields: {allowed}")
        args[name] = _value(op, name, RULES[rule].args[name], v, fline, source)
    return rule, args


def _value(op: str, name: str, kind: Any, v: yaml.ScalarNode, line: int, source: str) -> Any:
    """A field's value, typed as the rule declares it: an argument position, a choice, or a keyword name."""
    if kind is int:
        if v.tag != _INT or int(v.value) < 0:
            raise TPCompileError(f"rule file {source} line {line}: {op}: {name}: {v.value!r} is not an argument "
                                 f"position (an int >= 0)")
        return int(v.value)
    if isinstance(kind, tuple):
        if v.tag != _STR or v.value not in kind:
            raise TPCompileError(f"rule file {source} line {line}: {op}: {name}: {v.value!r}; use one of "
                                 f"{', '.join(kind)}")
        return v.value
    if v.tag != _STR:
        raise TPCompileError(f"rule file {source} line {line}: {op}: {name}: {v.value!r} must be a keyword name")
    return v.value
