"""An SVG picture of a graph without graphviz: layered boxes coloured by placement, collectives marked."""
from __future__ import annotations

from typing import Sequence
from xml.sax.saxutils import escape

from tpcompile.report.graph_layout import Placed, layout
from tpcompile.report.node_table import NodeInfo

# kind -> (fill, stroke, text colour, legend label)
STYLE: dict[str, tuple[str, str, str, str]] = {
    "input": ("#e8eaf6", "#3949ab", "#1a237e", "input / output"),
    "param": ("#fff8e1", "#a1887f", "#4e342e", "parameter"),
    "replicated": ("#eceff1", "#607d8b", "#263238", "replicated"),
    "shard": ("#c8e6c9", "#2e7d32", "#1b5e20", "sharded"),
    "partial": ("#ffe0b2", "#ef6c00", "#8a3c00", "partial sum"),
    "collective": ("#d32f2f", "#7f0000", "#ffffff", "collective"),
    "size": ("#f3e5f5", "#8e24aa", "#4a148c", "run-time size (edges omitted)"),
    "other": ("#ffffff", "#9e9e9e", "#424242", "no placement (new node)"),
}
STYLE["output"] = STYLE["input"]
CHAR_W, LINE_H, MAX_CHARS = 6.6, 12.0, 28
LEGEND_H = 72.0
LANE = 40.0  # room between columns for edges that skip rows


def short_op(info: NodeInfo) -> str:
    """'linear' for aten.linear.default, 'all_reduce' for a collective, the opcode for the rest."""
    if info.op == "call_function":
        parts = info.target.split(".")
        return parts[1] if len(parts) >= 3 and parts[0] in ("aten", "tpcompile", "tpcompile_rng") else parts[-1]
    if info.op == "get_attr":
        return "param"
    return "input" if info.op == "placeholder" else info.op


def _labels(info: NodeInfo) -> tuple[str, str]:
    """The two text lines of a box: the node's name, then its op and placement (a parameter: its shape)."""
    second = short_op(info)
    if info.op == "get_attr" and info.shape:
        second = info.shape.split(" ")[0]
    elif info.placement:
        second += f" \u00b7 {info.placement}"
    return _cut(info.name), _cut(second)


def _cut(text: str) -> str:
    """Text at most MAX_CHARS long, shortened from the start behind an ellipsis: the end of a name says the
    most ('…rmer_h_0_attn_c_attn_weight', 'masked_fill_scalar_1')."""
    return text if len(text) <= MAX_CHARS else "\u2026" + text[len(text) - MAX_CHARS + 1:]


def _box(p: Placed) -> str:
    """The SVG of one node: a shape (hexagon for collectives), two text lines, a tooltip."""
    fill, stroke, ink, _ = STYLE.get(p.info.kind, STYLE["other"])
    left, top, w, h = p.x - p.w / 2, p.y, p.w, p.h
    tip = escape(f"{p.info.name} = {p.info.target}  [{p.info.placement or '-'}]  {p.info.shape}  {p.info.module}")
    if p.info.kind == "collective":
        k = h / 2
        pts = [(left, top + k), (left + k, top), (left + w - k, top), (left + w, top + k),
               (left + w - k, top + h), (left + k, top + h)]
        shape = (f'<polygon points="{" ".join(f"{a:.1f},{b:.1f}" for a, b in pts)}" fill="{fill}" '
                 f'stroke="{stroke}" stroke-width="2"/>')
    else:
        rx = h / 2 if p.info.kind in ("input", "output") else 4
        dash = ' stroke-dasharray="4 2"' if p.info.kind == "param" else ""
        shape = (f'<rect x="{left:.1f}" y="{top:.1f}" width="{w:.1f}" height="{h:.1f}" rx="{rx:.1f}" '
                 f'fill="{fill}" stroke="{stroke}"{dash}/>')
    first, second = (escape(t) for t in _labels(p.info))
    cx = p.x
    return (f'<g><title>{tip}</title>{shape}'
            f'<text x="{cx:.1f}" y="{top + LINE_H:.1f}" fill="{ink}" font-weight="bold">{first}</text>'
            f'<text x="{cx:.1f}" y="{top + 2 * LINE_H + 1:.1f}" fill="{ink}">{second}</text></g>')


def _edge(a: Placed, b: Placed) -> str:
    """A curve from the bottom of a to the top of b; red when it enters or leaves a collective."""
    hot = "collective" in (a.info.kind, b.info.kind)
    colour, width = ("#c62828", 1.6) if hot else ("#90a4ae", 1.0)
    style = f'stroke="{colour}" stroke-width="{width}" fill="none" marker-end="url(#arrow)"'
    if b.y - (a.y + a.h) > 3 * a.h and abs(b.x - a.x) < a.w:
        # an edge that skips rows (a residual) leaves and enters by the left side and runs in the lane
        # between columns instead of through the boxes in between; a cubic bows 3/4 of its control offset
        x1, y1, x2, y2 = a.x - a.w / 2, a.y + a.h / 2, b.x - b.w / 2, b.y + b.h / 2
        off = LANE / 2 / 0.75
        curve = f"C{x1 - off:.1f},{y1:.1f} {x2 - off:.1f},{y2:.1f} {x2:.1f},{y2:.1f}"
        return f'<path d="M{x1:.1f},{y1:.1f} {curve}" {style}/>'
    x1, y1, x2, y2 = a.x, a.y + a.h, b.x, b.y
    bend = max(12.0, (y2 - y1) / 3)
    curve = f"C{x1:.1f},{y1 + bend:.1f} {x2:.1f},{y2 - bend:.1f} {x2:.1f},{y2:.1f}"
    return f'<path d="M{x1:.1f},{y1:.1f} {curve}" {style}/>'


def legend_notes(hidden: Sequence[str]) -> list[str]:
    """The lines under the swatches: how to read a box's labels, and the nodes left out."""
    lines = ["R: whole on every rank; S(d): split along dim d (|a+b: per segment, ~N: padded to N)",
             "\u2026 marks a shortened name: hover a box for all of it"]
    if hidden:
        lines[1] += f"; not drawn, as nothing uses them: {', '.join(hidden)}"
    return lines


def _legend(title: str, kinds: set[str], hidden: Sequence[str]) -> list[str]:
    """The title, one swatch per kind present in the graph, how to read the labels, and what is not drawn."""
    out = [f'<text x="8" y="16" text-anchor="start" font-weight="bold" font-size="13">{escape(title)}</text>']
    for k, line in enumerate(legend_notes(hidden)):
        out.append(f'<text x="8" y="{52 + 14 * k}" text-anchor="start" fill="#455a64">{escape(line)}</text>')
    x = 8.0
    for kind, (fill, stroke, _, label) in STYLE.items():
        if kind == "output" or (kind not in kinds and not (kind == "input" and "output" in kinds)):
            continue
        out.append(f'<rect x="{x:.1f}" y="24" width="14" height="12" fill="{fill}" stroke="{stroke}"/>')
        out.append(f'<text x="{x + 18:.1f}" y="34" text-anchor="start">{escape(label)}</text>')
        x += 30 + CHAR_W * len(label)
    return out


def render_svg(infos: Sequence[NodeInfo], title: str) -> str:
    """A standalone SVG document of the graph, top to bottom in execution order."""
    # a parameter read under a second name (the tied half of an embedding / LM head pair) and export's
    # input-guard call have no users: boxes without edges would only puzzle
    used = {n for i in infos for n in i.inputs}
    hidden = [i.name for i in infos if i.name not in used and i.op in ("get_attr", "call_module")]
    infos = [i for i in infos if i.name not in hidden]
    longest = max((len(t) for i in infos for t in _labels(i)), default=8)
    box_w, box_h = CHAR_W * min(longest, MAX_CHARS) + 14, 2 * LINE_H + 8
    placed = layout(infos, box_w=box_w, box_h=box_h, gap_x=LANE, top=LEGEND_H)
    at = {p.info.name: p for p in placed}
    width = max([p.x + p.w / 2 + 14 for p in placed] + [16 + CHAR_W * len(n) for n in legend_notes(hidden)])
    height = max([p.y + p.h + 14 for p in placed] + [LEGEND_H + 20])
    # a size feeds every reshape below it: its edges would cover the picture, the tooltips name it
    edges = [_edge(at[n], p) for p in placed for n in p.info.inputs if n in at and at[n].info.kind != "size"]
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="DejaVu Sans Mono, Menlo, Consolas, monospace" '
        f'font-size="11" text-anchor="middle">',
        '<defs><marker id="arrow" viewBox="0 0 8 8" refX="8" refY="4" markerWidth="6" markerHeight="6" '
        'orient="auto"><path d="M0,0 L8,4 L0,8 z" fill="#78909c"/></marker></defs>',
        f'<rect width="{width:.0f}" height="{height:.0f}" fill="#ffffff"/>',
        *_legend(title, {i.kind for i in infos}, hidden),
        '<g id="edges">', *edges, '</g>',
        '<g id="nodes">', *(_box(p) for p in placed), '</g>',
        '</svg>',
    ]
    return "\n".join(parts) + "\n"
