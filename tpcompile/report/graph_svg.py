"""An SVG picture of a graph without graphviz: layered boxes coloured by placement, collectives marked."""
from __future__ import annotations

import zlib
from typing import Sequence
from xml.sax.saxutils import escape

from tpcompile.report.graph_fold import fold_plumbing
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
    "folded": ("#f5f5f5", "#757575", "#424242", "folded plumbing"),
}
STYLE["output"] = STYLE["input"]
CHAR_W, LINE_H, MAX_CHARS = 6.6, 12.0, 28
LEGEND_H = 86.0
LANE = 40.0  # room between columns for edges that skip rows
GAP_Y = 22.0  # between rows: where edges change lanes
TRACKS = 7  # parallel tracks in a lane, LANE / (TRACKS + 1) apart


def short_op(info: NodeInfo) -> str:
    """'linear' for aten.linear.default, 'all_reduce' for a collective, the opcode for the rest."""
    if info.op == "call_function":
        parts = info.target.split(".")
        return parts[1] if len(parts) >= 3 and parts[0] in ("aten", "tpcompile", "tpcompile_rng") else parts[-1]
    if info.op == "get_attr":
        return "param"
    return "input" if info.op == "placeholder" else info.op


def _labels(info: NodeInfo) -> tuple[str, str]:
    """The two text lines of a box: the node's name, then its op and placement (a parameter: its shape; a
    folded box: how many nodes it holds). A collective's name is never shortened."""
    second = short_op(info)
    if info.op == "get_attr" and info.shape:
        second = info.shape.split(" ")[0]
    elif info.kind == "folded":
        second = f"{info.shape} folded"
    elif info.placement:
        second += f" \u00b7 {info.placement}"
    if info.kind == "collective":
        return info.name, second
    return _cut(info.name), _cut(second)


def _cut(text: str) -> str:
    """Text at most MAX_CHARS long, shortened from the start behind an ellipsis: the end of a name says the
    most ('…rmer_h_0_attn_c_attn_weight', 'masked_fill_scalar_1')."""
    return text if len(text) <= MAX_CHARS else "\u2026" + text[len(text) - MAX_CHARS + 1:]


def _box(p: Placed) -> str:
    """The SVG of one node: a shape (hexagon for collectives), two text lines, a tooltip."""
    fill, stroke, ink, _ = STYLE.get(p.info.kind, STYLE["other"])
    left, top, w, h = p.x - p.w / 2, p.y, p.w, p.h
    tip = escape(f"{p.info.name} = {p.info.target}  [{p.info.placement or '-'}]  {p.info.shape}  {p.info.module}"
                 if p.info.kind != "folded" else f"{p.info.name}: {p.info.shape} folded: {p.info.target}")
    if p.info.kind == "collective":
        k = h / 2
        pts = [(left, top + k), (left + k, top), (left + w - k, top), (left + w, top + k),
               (left + w - k, top + h), (left + k, top + h)]
        shape = (f'<polygon points="{" ".join(f"{a:.1f},{b:.1f}" for a, b in pts)}" fill="{fill}" '
                 f'stroke="{stroke}" stroke-width="2"/>')
    else:
        rx = h / 2 if p.info.kind in ("input", "output") else 4
        dash = {"param": ' stroke-dasharray="4 2"', "folded": ' stroke-dasharray="1 2"'}.get(p.info.kind, "")
        shape = (f'<rect x="{left:.1f}" y="{top:.1f}" width="{w:.1f}" height="{h:.1f}" rx="{rx:.1f}" '
                 f'fill="{fill}" stroke="{stroke}"{dash}/>')
    first, second = (escape(t) for t in _labels(p.info))
    cx = p.x
    return (f'<g><title>{tip}</title>{shape}'
            f'<text x="{cx:.1f}" y="{top + LINE_H:.1f}" fill="{ink}" font-weight="bold">{first}</text>'
            f'<text x="{cx:.1f}" y="{top + 2 * LINE_H + 1:.1f}" fill="{ink}">{second}</text></g>')


def _edge(a: Placed, b: Placed, step: float, track: int) -> str:
    """A path from the bottom of a to the top of b; red when it enters or leaves a collective.

    Between adjacent rows it is one curve through the gap between them. An edge that skips rows turns
    in the gap below a into the lane beside a's column (on b's side), runs down the lane, and turns in
    the gap above b to b's column: lanes and gaps hold no box, so it crosses none.
    """
    hot = "collective" in (a.info.kind, b.info.kind)
    colour, width = ("#c62828", 1.6) if hot else ("#90a4ae", 1.0)
    style = f'stroke="{colour}" stroke-width="{width}" fill="none" marker-end="url(#arrow)"'
    x1, y1, x2, y2 = a.x, a.y + a.h, b.x, b.y
    if y2 - y1 <= GAP_Y + 1:
        bend = max(12.0, (y2 - y1) / 3)
        curve = f"C{x1:.1f},{y1 + bend:.1f} {x2:.1f},{y2 - bend:.1f} {x2:.1f},{y2:.1f}"
        return f'<path d="M{x1:.1f},{y1:.1f} {curve}" {style}/>'
    side = 1.0 if x2 > x1 + 1 else -1.0
    lane = x1 + side * step / 2 + (track - TRACKS // 2) * LANE / (TRACKS + 1)
    ya, yb = y1 + GAP_Y / 2, y2 - GAP_Y / 2
    return f'<path d="{_rounded([(x1, y1), (x1, ya), (lane, ya), (lane, yb), (x2, yb), (x2, y2)])}" {style}/>'


def _rounded(points: list[tuple[float, float]], radius: float = 6.0) -> str:
    """An SVG path through `points` with straight runs and small rounded corners (each corner stays within
    the gap or lane its two runs share)."""
    out = [f"M{points[0][0]:.1f},{points[0][1]:.1f}"]
    for (px, py), (cx, cy), (nx, ny) in zip(points, points[1:], points[2:]):
        r_in = min(radius, abs(cx - px) / 2 + abs(cy - py) / 2)
        r_out = min(radius, abs(nx - cx) / 2 + abs(ny - cy) / 2)
        ax, ay = cx - _sign(cx - px) * r_in, cy - _sign(cy - py) * r_in
        bx, by = cx + _sign(nx - cx) * r_out, cy + _sign(ny - cy) * r_out
        out.append(f"L{ax:.1f},{ay:.1f} Q{cx:.1f},{cy:.1f} {bx:.1f},{by:.1f}")
    out.append(f"L{points[-1][0]:.1f},{points[-1][1]:.1f}")
    return " ".join(out)


def _sign(v: float) -> float:
    """-1, 0 or 1."""
    return (v > 0) - (v < 0)


def legend_notes(hidden: Sequence[str], folded: int = 0) -> list[str]:
    """The lines under the swatches: how to read a box's labels, and the nodes left out."""
    lines = ["R: whole on every rank; S(d): split along dim d (|a+b: per segment, ~N: padded to N); P: each rank "
             "holds a partial sum (the collective below adds them)",
             "\u2026 marks a shortened name: hover a box for all of it"]
    if folded:
        lines.append(f"a dotted box folds {folded} nodes that read no weight (masks, positions, rotary tables), "
                     "named by the values it hands on; nodes.txt lists them")
    if hidden:
        lines[1] += f"; not drawn, as nothing uses them: {', '.join(hidden)}"
    return lines


def _legend(title: str, kinds: set[str], hidden: Sequence[str], folded: int = 0) -> list[str]:
    """The title, one swatch per kind present in the graph, how to read the labels, and what is not drawn."""
    out = [f'<text x="8" y="16" text-anchor="start" font-weight="bold" font-size="13">{escape(title)}</text>']
    for k, line in enumerate(legend_notes(hidden, folded)):
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
    infos, _ = fold_plumbing([i for i in infos if i.name not in hidden])
    folded = sum(int(i.shape.split()[0]) for i in infos if i.kind == "folded")
    longest = max((len(t) for i in infos if i.kind != "collective" for t in _labels(i)), default=8)
    widest = max((len(t) for i in infos if i.kind == "collective" for t in _labels(i)), default=0)
    box_w, box_h = CHAR_W * max(min(longest, MAX_CHARS), widest) + 14, 2 * LINE_H + 8
    placed = layout(infos, box_w=box_w, box_h=box_h, gap_x=LANE, gap_y=GAP_Y, top=LEGEND_H)
    at = {p.info.name: p for p in placed}
    notes = legend_notes(hidden, folded)
    width = max([p.x + p.w / 2 + 14 for p in placed] + [16 + CHAR_W * len(n) for n in notes])
    height = max([p.y + p.h + 14 for p in placed] + [LEGEND_H + 20])
    # a size feeds every reshape below it: its edges would cover the picture, the tooltips name it
    step = box_w + LANE
    edges = [_edge(at[n], p, step, zlib.crc32(n.encode()) % TRACKS) for p in placed for n in p.info.inputs
             if n in at and at[n].info.kind != "size"]
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="DejaVu Sans Mono, Menlo, Consolas, monospace" '
        f'font-size="11" text-anchor="middle">',
        '<defs><marker id="arrow" viewBox="0 0 8 8" refX="8" refY="4" markerWidth="6" markerHeight="6" '
        'orient="auto"><path d="M0,0 L8,4 L0,8 z" fill="#78909c"/></marker></defs>',
        f'<rect width="{width:.0f}" height="{height:.0f}" fill="#ffffff"/>',
        *_legend(title, {i.kind for i in infos}, hidden, folded),
        '<g id="edges">', *edges, '</g>',
        '<g id="nodes">', *(_box(p) for p in placed), '</g>',
        '</svg>',
    ]
    return "\n".join(parts) + "\n"
