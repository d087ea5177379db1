"""The SVG dump as a reader sees it: no edge through another box, every placement letter explained, collective
names whole, and weight-free plumbing (masks, rotary tables) folded into one box."""
from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import torch
from torch import nn

import tpcompile
from tpcompile.models import build
from tpcompile.report.graph_svg import render_svg
from tpcompile.report.node_table import node_infos

NS = "{http://www.w3.org/2000/svg}"
Box = tuple[float, float, float, float]  # left, top, right, bottom


def _boxes(root: ET.Element) -> list[tuple[str, Box]]:
    """Every node's title and bounding box (rectangles and collective hexagons)."""
    out = []
    for g in root.find(f"{NS}g[@id='nodes']"):
        title = g.find(f"{NS}title").text
        rect, poly = g.find(f"{NS}rect"), g.find(f"{NS}polygon")
        if rect is not None:
            x, y, w, h = (float(rect.get(k)) for k in ("x", "y", "width", "height"))
            out.append((title, (x, y, x + w, y + h)))
        else:
            pts = [tuple(map(float, p.split(","))) for p in poly.get("points").split()]
            out.append((title, (min(p[0] for p in pts), min(p[1] for p in pts), max(p[0] for p in pts),
                                max(p[1] for p in pts))))
    return out


def _points(d: str) -> list[tuple[float, float]]:
    """Points along an SVG path of M, L, Q and C commands, every curve sampled."""
    tokens = re.findall(r"[MLQC]|-?\d+(?:\.\d+)?", d)
    pts: list[tuple[float, float]] = []
    cmd, nums = "", []
    for tok in tokens + ["M"]:
        if tok in "MLQC":
            if cmd:
                ctrl = [(nums[k], nums[k + 1]) for k in range(0, len(nums), 2)]
                start = pts[-1] if pts else ctrl[0]
                if cmd in "ML":
                    pts.extend([(start[0] + (ctrl[0][0] - start[0]) * t / 20, start[1] + (ctrl[0][1] - start[1]) * t / 20)
                                for t in range(1, 21)] if pts else ctrl)
                else:
                    ps = [start] + ctrl
                    for t in (k / 20 for k in range(1, 21)):
                        q = ps
                        while len(q) > 1:
                            q = [(a[0] + (b[0] - a[0]) * t, a[1] + (b[1] - a[1]) * t) for a, b in zip(q, q[1:])]
                        pts.append(q[0])
            cmd, nums = tok, []
        else:
            nums.append(float(tok))
    return pts


def _inside(p: tuple[float, float], b: Box) -> bool:
    """p strictly inside box b (a pixel of slack at the border)."""
    return b[0] + 1 < p[0] < b[2] - 1 and b[1] + 1 < p[1] < b[3] - 1


def test_edges_run_around_boxes() -> None:
    """Every edge of GPT's rank 0 picture leaves its source's bottom and enters its target's top without
    crossing a third box; P is explained and collective names are whole."""
    model = build("gpt")
    sm = tpcompile.shard(model, 2)
    root = ET.fromstring(render_svg(node_infos(sm.rank(0)), "rank 0"))
    boxes = _boxes(root)
    paths = [p.get("d") for p in root.find(f"{NS}g[@id='edges']")]
    long_edges = 0
    for d in paths:
        pts = _points(d)
        (x0, y0), (x1, y1) = pts[0], pts[-1]
        ends = [t for t, b in boxes if (abs(b[3] - y0) < 0.6 and b[0] <= x0 <= b[2]) or
                (abs(b[1] - y1) < 0.6 and b[0] <= x1 <= b[2])]
        assert len(ends) >= 2, d
        crossed = {t for p in pts for t, b in boxes if t not in ends and _inside(p, b)}
        assert not crossed, (d, crossed)
        long_edges += y1 - y0 > 200
    assert long_edges > 0  # the residual and tied-weight edges that skip rows are among those checked
    texts = [t.text for t in root.iter(f"{NS}text")]
    assert any("P: each rank holds a partial sum" in t for t in texts)
    assert "all_gather_replicated_default" in texts
    (idx,) = model.example_inputs()
    with torch.no_grad():  # numerical twin: the pictured rank graphs compute the original
        for out in tpcompile.simulate(sm, idx):
            torch.testing.assert_close(out, model(idx), atol=1e-5, rtol=1.3e-6)


class Rotary(nn.Module):
    """A rotary-style table and a causal average, both computed from the length alone, around two split linears."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(64, 32)
        self.up = nn.Linear(32, 32)
        self.out = nn.Linear(32, 64)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 16).float() / 16)), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device).float()
        freqs = torch.outer(pos, self.inv_freq)
        table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # (T, 32)
        causal = (pos[None, :] <= pos[:, None]).float()
        average = causal / causal.sum(-1, keepdim=True)  # (T, T): each position the mean of those before it
        h = average @ self.emb(ids)
        return self.out(torch.relu(self.up(h) * table))


def test_plumbing_is_folded() -> None:
    """The mask and the rotary table, computed without any weight, are one dotted box named by what it hands on."""
    model = Rotary().eval()
    ids = torch.randint(0, 64, (2, 8))
    sm = tpcompile.shard(model, 2, example_inputs=(ids,))
    infos = node_infos(sm.rank(0))
    root = ET.fromstring(render_svg(infos, "rank 0"))
    titles = [t.text for t in root.iter(f"{NS}title")]
    folded = [t for t in titles if " folded: " in t]
    assert len(folded) == 1 and folded[0].startswith("cat, div: "), folded  # the table and the averages
    members = folded[0].split(" folded: ")[1].split(", ")
    assert {"cos", "sin", "outer"} <= set(members) and any(m.startswith("le") for m in members)
    assert not any(t.split(" = ")[0] in members for t in titles if " = " in t)
    assert any(t.startswith("linear = ") for t in titles)  # the weights' work stays drawn node by node
    with torch.no_grad():
        for out in tpcompile.simulate(sm, ids):
            torch.testing.assert_close(out, model(ids), atol=1e-5, rtol=1.3e-6)
