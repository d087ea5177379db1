"""Per-node facts of a graph (name, op, target, placement, kind, shape, module) and their text table."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from torch.fx import GraphModule, Node

from tpcompile.ops.schedule import collective_op
from tpcompile.passes.pass_context import module_path
from tpcompile.placement import Replicate, Shard

# Reduction collectives: their input is each rank's partial sum, whatever the meta says.
_REDUCING = ("all_reduce", "reduce_scatter")


@dataclass(frozen=True)
class NodeInfo:
    """What one node is, for tables and pictures."""

    name: str
    op: str  # fx opcode
    target: str  # short target: 'aten.linear.default', 'tpcompile.all_reduce', a parameter path
    placement: str  # str of the node's placement (the frozen plan's, or a rank node's tp_placement), '' where none
    kind: str  # input | param | size | output | collective | replicated | shard | partial | other
    shape: str  # from a traced forward, '' where unknown
    module: str  # innermost nn.Module path the node was traced in
    inputs: tuple[str, ...]
    weight: bool = False  # a get_attr of an nn.Parameter (not a buffer)


def target_name(node: Node) -> str:
    """The node's target as a short readable string."""
    t = node.target
    if node.op in ("placeholder", "get_attr", "output"):
        return str(t)
    ns = getattr(t, "namespace", None)
    if ns is not None:  # an OpOverload: 'aten.view.default', 'tpcompile.all_reduce.default'
        return f"{ns}.{t._opname}.{t._overloadname}"
    return getattr(t, "__name__", str(t))


def placement_text(p: Any) -> str:
    """A placement as text ('R', 'S(2)', a tuple for multi-output ops; '' for none)."""
    if p is None:
        return ""
    if isinstance(p, tuple):
        return "(" + ", ".join(str(x) for x in p) + ")"
    return str(p)


def _kind(node: Node, p: Any) -> str:
    """Which colour class the node (placed `p`) belongs to."""
    if node.op == "placeholder":
        return "input"
    if node.op == "get_attr":
        return "param"
    if node.op == "output":
        return "output"
    if collective_op(node) is not None:
        return "collective"
    if any(collective_op(u) in _REDUCING for u in node.users):
        return "partial"
    parts = p if isinstance(p, tuple) else (p,)
    if any(isinstance(x, Shard) for x in parts):
        return "shard"
    if any(isinstance(x, Replicate) for x in parts):
        return "replicated"
    return "other"


def _is_size(node: Node, sizes: set[str]) -> bool:
    """A run-time size: sym_size of a tensor, or integer arithmetic on sizes (floordiv by the world size)."""
    if node.op != "call_function":
        return False
    t = node.target
    if getattr(t, "namespace", None) == "aten" and t._opname.startswith("sym_"):
        return True
    return (getattr(t, "__module__", None) in ("_operator", "operator")
            and bool(node.all_input_nodes) and all(i.name in sizes for i in node.all_input_nodes))


def node_infos(gm: GraphModule, shapes: Optional[dict[str, str]] = None,
               placement: Optional[Callable[[Node], Any]] = None) -> list[NodeInfo]:
    """One NodeInfo per node of gm, in graph order; shapes from a Trace where given; placements from `placement`
    (the frozen plan's, for the captured graph), else the nodes' own `tp_placement` (a rank graph's)."""
    placement = placement or (lambda n: n.meta.get("tp_placement"))
    shapes = shapes or {}
    sizes: set[str] = set()
    params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    out = []
    for n in gm.graph.nodes:
        p = placement(n)
        kind = "size" if _is_size(n, sizes) else _kind(n, p)
        if kind == "size":
            sizes.add(n.name)
        out.append(NodeInfo(n.name, n.op, target_name(n), placement_text(p), kind, shapes.get(n.name, ""),
                            _module(n), tuple(i.name for i in n.all_input_nodes),
                            n.op == "get_attr" and str(n.target) in params))
    return out


def _module(node: Node) -> str:
    """The module a node was traced in; a parameter's own module for get_attr nodes."""
    return str(node.target).rpartition(".")[0] if node.op == "get_attr" else module_path(node)


def node_table(infos: list[NodeInfo]) -> str:
    """A fixed-width text table of the nodes: name, op, target, placement, shape, module."""
    header = ("name", "op", "target", "placement", "shape", "module")
    rows = [header] + [(i.name, i.op, i.target, i.placement or "-", i.shape or "-", i.module or "-")
                       for i in infos]
    widths = [max(len(r[c]) for r in rows) for c in range(len(header) - 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths) + "  " + "-" * len(header[-1]))
    return "\n".join(line.rstrip() for line in lines) + "\n"


def legend(infos: list[Any]) -> str:
    """'12 replicated, 30 shard, ...': how many nodes of each kind."""
    counts: dict[str, int] = {}
    for i in infos:
        counts[i.kind] = counts.get(i.kind, 0) + 1
    return ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
