"""A layered top-to-bottom layout of a graph: layers by longest path, x by the inputs' positions, on a grid of
columns so that the lanes between them stay free for long edges."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tpcompile.report.node_table import NodeInfo

# Parameters and inputs float down next to their first user instead of all sitting in the top row.
_FLOATING = ("param", "input")
# Run-time sizes feed many reshapes far below; they do not pull their users sideways.
_ASIDE = _FLOATING + ("size",)


@dataclass(frozen=True)
class Placed:
    """A node's box: centre x, top y, size."""

    info: NodeInfo
    x: float
    y: float
    w: float
    h: float


def layers_of(infos: Sequence[NodeInfo]) -> dict[str, int]:
    """Layer of every node: one below its deepest input; parameters and inputs just above their first user."""
    layer: dict[str, int] = {}
    kind = {i.name: i.kind for i in infos}
    for i in infos:  # graph order is topological
        fixed = [layer[x] for x in i.inputs if kind.get(x) not in _FLOATING and x in layer]
        layer[i.name] = 1 + max(fixed, default=0) if i.kind not in _FLOATING else 0
    users: dict[str, list[int]] = {}
    for i in infos:
        for x in i.inputs:
            users.setdefault(x, []).append(layer[i.name])
    for i in infos:
        if i.kind in _FLOATING:
            layer[i.name] = max(0, min(users.get(i.name, [1])) - 1)
    return layer


def layout(infos: Sequence[NodeInfo], *, box_w: float, box_h: float, gap_x: float = 14.0,
           gap_y: float = 22.0, top: float = 0.0) -> list[Placed]:
    """Boxes for every node: each layer a row, each node as close as it can be below its inputs."""
    layer = layers_of(infos)
    rows: dict[int, list[NodeInfo]] = {}
    for i in infos:
        rows.setdefault(layer[i.name], []).append(i)
    x: dict[str, float] = {}
    kind = {i.name: i.kind for i in infos}
    first_user: dict[str, NodeInfo] = {}
    for i in infos:
        for n in i.inputs:
            first_user.setdefault(n, i)
    step = box_w + gap_x
    for depth in sorted(rows):
        row = rows[depth]
        wanted = []
        for k, i in enumerate(row):
            if i.kind in _FLOATING and i.name in first_user:
                # beside the user's other inputs, to the right, so the main chain stays straight
                u = first_user[i.name]
                mates = [x[n] for n in u.inputs if n in x and kind.get(n) not in _ASIDE]
                floats = [n for n in u.inputs if kind.get(n) in _FLOATING]
                base = sum(mates) / len(mates) if mates else 0.0
                wanted.append(base + step * (1 + floats.index(i.name)))
                continue
            known = [x[n] for n in i.inputs if n in x and kind.get(n) not in _ASIDE]
            known = known or [x[n] for n in i.inputs if n in x]
            wanted.append(sum(known) / len(known) if known else k * step)
        x.update(_on_grid(_spread([i.name for i in row], wanted, step, [i.kind not in _FLOATING for i in row]), step))
    left = min(x.values(), default=0.0) - box_w / 2 - gap_x
    return [Placed(i, x[i.name] - left, top + gap_y + layer[i.name] * (box_h + gap_y), box_w, box_h) for i in infos]


def _spread(names: list[str], wanted: list[float], step: float, anchors: list[bool]) -> dict[str, float]:
    """Positions `step` apart in the order wanted, shifted so the anchors sit on theirs on average."""
    order = sorted(range(len(names)), key=lambda k: (wanted[k], k))
    pos: list[float] = []
    for k in order:
        pos.append(wanted[k] if not pos else max(wanted[k], pos[-1] + step))
    pulls = [wanted[k] - p for k, p in zip(order, pos) if anchors[k]]
    pulls = pulls or [wanted[k] - p for k, p in zip(order, pos)]
    shift = sum(pulls) / len(pulls)
    return {names[k]: p + shift for k, p in zip(order, pos)}


def _on_grid(pos: dict[str, float], step: float) -> dict[str, float]:
    """Positions moved onto multiples of `step`, in their order and `step` apart: boxes then stand in columns,
    so the lanes between the columns hold no box and an edge can run down them."""
    out: dict[str, float] = {}
    last = float("-inf")
    for name, x in sorted(pos.items(), key=lambda kv: kv[1]):
        last = max(round(x / step) * step, last + step)
        out[name] = last
    return out
