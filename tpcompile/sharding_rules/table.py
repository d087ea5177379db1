"""Reads ops.yaml into a lookup from an aten op overload to the rule that handles it."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from tpcompile.errors import TPCompileError
from tpcompile.sharding_rules.schema import parse_table

_TABLE_FILE = Path(__file__).with_name("ops.yaml")


@dataclass(frozen=True)
class RuleSpec:
    """One row of the op table: the rule's name and its arguments."""

    rule: str
    args: dict[str, Any] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        """An argument of the row, or `default`."""
        return self.args.get(key, default)


@functools.lru_cache(maxsize=None)
def load_table(path: str = str(_TABLE_FILE)) -> dict[str, RuleSpec]:
    """Op name ('aten.linear.default') -> RuleSpec, from the YAML table, every row checked (schema.py)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TPCompileError(f"rule file {path} cannot be read ({e}); pass the path of a UTF-8 YAML op table") from e
    return {op: RuleSpec(rule, args) for op, (rule, args, _) in parse_table(text, path).items()}


def op_name(target: Any) -> str:
    """The table key of a call_function target ('aten.add.Tensor'), or its repr."""
    name = getattr(target, "name", None)
    if callable(name) and getattr(target, "namespace", None) == "higher_order":  # a region op: no overloads
        return f"higher_order.{target.name()}.default"
    if callable(name) and hasattr(target, "_schema"):
        ns, _, rest = target.name().partition("::")
        return f"{ns}.{rest}" if "." in rest else f"{ns}.{rest}.default"
    return getattr(target, "__name__", str(target))


def lookup(target: Any) -> Optional[RuleSpec]:
    """The rule for a call_function target, or None when the table has no row."""
    return load_table().get(op_name(target))
