"""Reads ops.yaml into a lookup from an aten op overload to the rule that handles it."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

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
    """Op name ('aten.linear.default') -> RuleSpec, from the YAML table."""
    raw = yaml.safe_load(Path(path).read_text())
    table: dict[str, RuleSpec] = {}
    for key, value in raw.items():
        if key in ("pointwise", "no_output"):
            for op in value:
                table[op] = RuleSpec(key)
        else:
            value = dict(value)
            table[key] = RuleSpec(value.pop("rule"), value)
    return table


def op_name(target: Any) -> str:
    """The table key of a call_function target ('aten.add.Tensor'), or its repr."""
    name = getattr(target, "name", None)
    if callable(name) and hasattr(target, "_schema"):
        ns, _, rest = target.name().partition("::")
        return f"{ns}.{rest}" if "." in rest else f"{ns}.{rest}.default"
    return getattr(target, "__name__", str(target))


def lookup(target: Any) -> Optional[RuleSpec]:
    """The rule for a call_function target, or None when the table has no row."""
    return load_table().get(op_name(target))
