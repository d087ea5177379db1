"""Layout: what the rewriter must do around one node (propagate writes node.meta['tp_layout'], freeze keeps it in
the frozen plan, the rewrite reads it there)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from tpcompile.sharding_rules.rule_context import Want


@dataclass(frozen=True)
class Layout:
    """What the rewriter must do around one node."""

    role: str = "generic"
    wants: Sequence[Want] = ()
    localize: Optional[Sequence[tuple]] = None
    gather_output: bool = True
