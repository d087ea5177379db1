"""What the rewrite changed from the captured graph to one rank's graph, as sections and a code diff."""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from torch.fx import GraphModule, Node
from torch.fx.node import map_aggregate

from tpcompile.ops.schedule import collective_op
from tpcompile.passes.pass_context import module_path
from tpcompile.report.node_table import target_name
from tpcompile.report.plan_table import split_text

_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")


@dataclass
class GraphDiff:
    """The changes, each a list of display rows, in graph order."""

    rank: int
    world_size: int
    collectives: list[tuple[str, ...]] = field(default_factory=list)  # name, op(inputs), module
    added: list[tuple[str, ...]] = field(default_factory=list)  # name, target, module
    literals: list[tuple[str, ...]] = field(default_factory=list)  # name, target, "old -> new", module
    sliced: list[tuple[str, ...]] = field(default_factory=list)  # parameter, "old -> new", split
    removed: list[tuple[str, ...]] = field(default_factory=list)  # name, target, module
    code: list[str] = field(default_factory=list)  # unified diff lines


def code_lines(code: str) -> list[str]:
    """fx code as lines without trailing whitespace or surrounding blank lines; object addresses masked."""
    lines = [_ADDRESS.sub("0x?", line.rstrip()) for line in code.splitlines()]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _text(value: Any) -> str:
    """An argument as it reads in the code: nodes by name, lists in brackets."""
    if isinstance(value, Node):
        return value.name
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_text(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    return repr(value)


def _literals(args: Any) -> Any:
    """The arguments with every node replaced by one marker: what is left are the literals."""
    return map_aggregate(args, lambda v: "<node>" if isinstance(v, Node) else v)


def _literal_changes(old: Node, new: Node) -> list[str]:
    """'arg 1: [s, s, 4, 16] -> [s, s, 2, 16]' for each argument whose literals differ."""
    out = []
    for i, (a, b) in enumerate(zip(old.args, new.args)):
        if _literals(a) != _literals(b):
            out.append(f"arg {i}: {_text(a)} -> {_text(b)}")
    for key in sorted(set(old.kwargs) | set(new.kwargs)):
        a, b = old.kwargs.get(key), new.kwargs.get(key)
        if _literals(a) != _literals(b):
            out.append(f"{key}: {_text(a)} -> {_text(b)}")
    if len(old.args) != len(new.args):
        out.append(f"args: {_text(tuple(old.args))} -> {_text(tuple(new.args))}")
    return out


def _shape(gm: GraphModule, target: str) -> Optional[list[int]]:
    """The shape of the parameter or buffer at `target`, or None."""
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return list(obj.shape) if hasattr(obj, "shape") else None


def graph_diff(captured: GraphModule, gm: GraphModule, rank: int, world_size: int,
               splits: Optional[dict[str, str]] = None) -> GraphDiff:
    """Compare the captured graph with rank `rank`'s graph; nodes match by name and target."""
    splits = splits or {}
    before = {n.name: n for n in captured.graph.nodes}
    after = {n.name: n for n in gm.graph.nodes}
    same = {k for k, n in after.items() if k in before and before[k].target == n.target and before[k].op == n.op}
    d = GraphDiff(rank, world_size)
    for n in gm.graph.nodes:
        if n.name not in same:
            op = collective_op(n)
            if op is not None:
                d.collectives.append((n.name, f"{op}({', '.join(_text(a) for a in n.args)})", module_path(n) or "-"))
            else:
                d.added.append((n.name, target_name(n), module_path(n) or "-"))
        elif n.op == "get_attr":
            old, new = _shape(captured, n.target), _shape(gm, n.target)
            if old != new:
                d.sliced.append((str(n.target), f"{old} -> {new}", splits.get(str(n.target), "")))
        elif n.op == "call_function":
            for change in _literal_changes(before[n.name], n):
                d.literals.append((n.name, target_name(n), change, module_path(n) or "-"))
    d.removed = [(n.name, target_name(n), module_path(n) or "-") for n in captured.graph.nodes if n.name not in same]
    d.code = list(difflib.unified_diff(code_lines(captured.code), code_lines(gm.code), "captured",
                                       f"rank{rank}", lineterm=""))
    return d


def _rows(rows: list[tuple[str, ...]]) -> list[str]:
    """Rows as aligned columns, indented two spaces; '  (none)' for no rows."""
    if not rows:
        return ["  (none)"]
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]) - 1)]
    return [("  " + "  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1]).rstrip() for r in rows]


def render(d: GraphDiff, title: str) -> str:
    """The diff as text: a title, one section per kind of change, then the unified diff of the code."""
    out = [f"# {title}: captured graph -> rank {d.rank} of {d.world_size}"]
    sections = [
        ("collectives added", d.collectives),
        ("other nodes added", d.added),
        ("shape literals changed (old -> new)", d.literals),
        ("parameters sliced (old shape -> new shape)", d.sliced),
        ("nodes removed", d.removed),
    ]
    for heading, rows in sections:
        out += ["", f"## {heading}: {len(rows)}", *_rows(rows)]
    out += ["", f"## code (unified diff, captured -> rank {d.rank})", *d.code]
    return "\n".join(out) + "\n"


def diff_title(model_name: str, spec: str, *, sequence_parallel: bool = False) -> str:
    """'GPT (gpt)', with ', sequence parallel' when that was asked for."""
    return f"{model_name} ({spec}{', sequence parallel' if sequence_parallel else ''})"


def diff_text(sharded: Any, title: str, ranks: Any) -> str:
    """The rendered diffs of the given ranks of a ShardedModel, one after another."""
    splits: dict[str, str] = {}
    for name, pp in sharded.plan.parameters.items():
        for alias in (name, *pp.tied):
            splits[alias] = split_text(pp)
    return "\n".join(render(graph_diff(sharded.captured, sharded.rank(r), r, sharded.world_size, splits), title)
                     for r in ranks)
