"""The op table's schema: which rules exist, which arguments each takes, checked with line numbers.

The table is read with the safe YAML loader and every row is checked here before any rule runs,
so a typo in ops.yaml (or in a user's rule file) is an error naming the key and its line instead
of a silently missing or misapplied rule.
"""
from __future__ import annotations

import re
from typing import Any

import yaml

from tpcompile.errors import TPCompileError

INT_ARGS = ("input", "weight", "bias", "shape_arg", "sizes_arg", "dim_arg", "default_dim", "dims_arg", "keepdim_arg")
CHOICE_ARGS = {"weight_layout": ("out_in", "in_out")}
STR_ARGS = ("keepdim_kwarg",)
# rule name -> the arguments a row naming it may carry (argument positions in the aten schema)
RULE_ARGS: dict[str, tuple[str, ...]] = {
    "weight_matmul": ("input", "weight", "bias", "weight_layout"),
    "matmul": (), "embedding": (), "sdpa": (), "einsum": (),
    "reshape": ("shape_arg", "sizes_arg", "dim_arg"),
    "expand": ("shape_arg",),
    "transpose": (), "permute": (),
    "split": ("dim_arg", "default_dim"), "unbind": ("dim_arg", "default_dim"),
    "cat": ("dim_arg", "default_dim"), "slice": ("dim_arg", "default_dim"), "select": ("dim_arg",),
    "along_dim": ("dim_arg",),
    "reduce": ("dims_arg", "keepdim_arg", "keepdim_kwarg"),
    "norm": ("shape_arg",),
    "pointwise": (), "no_output": (),
}
LISTS = ("pointwise", "no_output")  # keys holding a list of op names that share one argument-less rule
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
        if key in LISTS:
            if not isinstance(value_node, yaml.SequenceNode):
                raise TPCompileError(f"rule file {source} line {line}: {key} must be a list of op names")
            for item in value_node.value:
                add(item, key, {})
        elif isinstance(value_node, yaml.MappingNode):
            add(key_node, *_row(key, value_node, source))
        else:
            raise TPCompileError(f"rule file {source} line {line}: {key}: the row must be a mapping such as "
                                 f"{{rule: pointwise}}; rules: {', '.join(sorted(RULE_ARGS))}")
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
                             f"one of {', '.join(sorted(RULE_ARGS))}")
    rule_node, _ = fields.pop("rule")
    rule = rule_node.value
    if rule not in RULE_ARGS:
        raise TPCompileError(f"rule file {source} line {line}: {op}: unknown rule {rule!r}; use one of "
                             f"{', '.join(sorted(RULE_ARGS))} (or list the op under pointwise)")
    args: dict[str, Any] = {}
    for name, (v, fline) in fields.items():
        if name not in RULE_ARGS[rule]:
            allowed = ", ".join(RULE_ARGS[rule]) or "none"
            raise TPCompileError(f"rule file {source} line {fline}: {op}: unknown field {name!r} for rule {rule}; "
                                 f"its fields: {allowed}")
        args[name] = _value(op, name, v, fline, source)
    return rule, args


def _value(op: str, name: str, v: yaml.ScalarNode, line: int, source: str) -> Any:
    """A field's value, typed: argument positions are non-negative ints, choices one of their words."""
    if name in INT_ARGS:
        if v.tag != _INT or int(v.value) < 0:
            raise TPCompileError(f"rule file {source} line {line}: {op}: {name}: {v.value!r} is not an argument "
                                 f"position (an int >= 0)")
        return int(v.value)
    if name in CHOICE_ARGS:
        if v.tag != _STR or v.value not in CHOICE_ARGS[name]:
            raise TPCompileError(f"rule file {source} line {line}: {op}: {name}: {v.value!r}; use one of "
                                 f"{', '.join(CHOICE_ARGS[name])}")
        return v.value
    if v.tag != _STR:
        raise TPCompileError(f"rule file {source} line {line}: {op}: {name}: {v.value!r} must be a keyword name")
    return v.value
