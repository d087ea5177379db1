"""node.meta['tp_layout']: what the rewriter must do around one node (written by propagate, read by rewrite)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tpcompile.sharding_rules.rule_context import Want


@dataclass
class Layout:
    """node.meta['tp_layout']: what the rewriter must do around one node."""

    role: str = "generic"
    wants: list[Want] = field(default_factory=list)
    localize: Optional[list[tuple]] = None
    gather_output: bool = True
