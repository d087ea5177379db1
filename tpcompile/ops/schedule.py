"""The collective schedule: which collectives a rank issues, in order, one record per call.

One record type serves the three places that compare ranks' schedules: the per-rank verifier
(passes/verify_ranks.py, from the rank graphs), the startup check (runtime/startup_check.py,
from a fake-tensor run) and the simulator (runtime/simulator.py, at each exchange).
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional, Union

from torch.fx import Graph, GraphModule, Node

__all__ = ["COLLECTIVE_OPS", "FORWARD_COLLECTIVES", "CollectiveCall", "collective_name", "collective_op",
           "graph_schedule"]

COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_gather_replicated",
                  "grad_all_reduce", "scatter")
# The collectives that communicate in forward (grad_all_reduce and scatter only do in backward).
FORWARD_COLLECTIVES = frozenset({"all_reduce", "all_gather", "reduce_scatter", "all_gather_replicated"})


class CollectiveCall(NamedTuple):
    """One collective as a rank issues it: the op, its input's shape as expressions, dtype, other arguments."""

    op: str
    shape: tuple[str, ...]
    dtype: str = "?"
    args: tuple = ()

    def __str__(self) -> str:
        return f"{self.op}(({', '.join(self.shape)}), {self.dtype}{''.join(f', {a}' for a in self.args)})"


def collective_name(target: Any) -> Optional[str]:
    """'all_reduce', 'all_gather', ... for one of the torch.ops.tpcompile.* ops, else None."""
    return target._opname if getattr(target, "namespace", None) == "tpcompile" else None


def collective_op(node: Node) -> Optional[str]:
    """The collective a node calls ('all_reduce', ...), else None."""
    return collective_name(node.target) if node.op == "call_function" else None


def graph_schedule(gm: Union[GraphModule, Graph]) -> list[tuple[CollectiveCall, Node]]:
    """Per collective node in graph order: its record (shape from node.meta['tp_shape']) and the node."""
    out = []
    for n in (gm.graph if isinstance(gm, GraphModule) else gm).nodes:
        op = collective_op(n)
        if op is not None:
            args = tuple(a for a in n.args[1:] if not isinstance(a, Node))
            out.append((CollectiveCall(op, tuple(n.meta.get("tp_shape") or ("?",)), "?", args), n))
    return out
