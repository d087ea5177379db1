"""The graph as graphviz DOT text, coloured like the SVG, for anyone who has `dot` installed."""
from __future__ import annotations

from typing import Sequence

from tpcompile.report.graph_svg import STYLE, short_op
from tpcompile.report.node_table import NodeInfo


def _quote(text: str) -> str:
    """A DOT double-quoted string."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_dot(infos: Sequence[NodeInfo], title: str) -> str:
    """A DOT digraph of the nodes and their data edges, top to bottom."""
    lines = ["digraph tpcompile {", f"  label={_quote(title)}; labelloc=t; rankdir=TB;",
             '  node [shape=box, style="rounded,filled", fontname="monospace", fontsize=10];']
    for i in infos:
        fill, stroke, ink, _ = STYLE.get(i.kind, STYLE["other"])
        label = "\\n".join(x for x in (i.name, short_op(i), i.placement, i.shape) if x)
        shape = ", shape=hexagon" if i.kind == "collective" else ""
        lines.append(f'  {_quote(i.name)} [label="{label}", fillcolor="{fill}", color="{stroke}", '
                     f'fontcolor="{ink}"{shape}];')
    for i in infos:
        for n in i.inputs:
            lines.append(f"  {_quote(n)} -> {_quote(i.name)};")
    lines.append("}")
    return "\n".join(lines) + "\n"
