"""Every rank's profiled steps as one report: per block its compute and collectives, waiting, the prediction beside.

Figures are means per step, first over a rank's steps, then over the ranks that ran the block (or
collective), so the parts of `step_ms` add up to it: the blocks' compute, their collectives, the
loop's regions (loss, optimizer), the pipeline's waiting and `other_ms` (what nothing labels).
A collective's `wait_ms` is the part of its time spent waiting for the last rank of its group to
arrive (arrival: the call's start after the step's barrier); the rest is its own cost.
"""
from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

__all__ = ["ProfileReport", "build_report", "TERMS"]

TERMS = ("compute", "tp_comm", "dp_comm", "pp_comm", "bubble", "optimizer", "overhead")
OFF = 0.25  # a term whose measured / predicted ratio is further than this from 1 is named
NOTABLE = 0.05  # ... when it is at least this fraction of the step (measured or predicted)


def _waits(ranks: list[Any]) -> dict[tuple[int, int, int], float]:
    """(rank, step, call) -> ms the call waited for the last rank of its group to arrive."""
    groups: dict[tuple, list[Any]] = defaultdict(list)
    for rp in ranks:
        groups[tuple(rp.peers)].append(rp)
    out: dict[tuple[int, int, int], float] = {}
    for members in groups.values():
        for k in range(min(len(rp.steps) for rp in members)):
            arrivals: dict[tuple, dict[int, tuple[int, float, float]]] = defaultdict(dict)
            for rp in members:
                for ci, c in enumerate(rp.steps[k].calls):
                    if c.phase != "outside":
                        arrivals[(c.phase, c.node, c.op, c.index)][rp.rank] = (ci, c.start_ms, c.ms)
            for got in arrivals.values():
                last = max(start for _, start, _ in got.values())
                for r, (ci, start, ms) in got.items():
                    out[(r, k, ci)] = min(ms, max(0.0, last - start))
    return out


def _mean(values: list[float]) -> float:
    """The mean (0 for none)."""
    return sum(values) / len(values) if values else 0.0


def _per_rank(ranks: list[Any], waits: dict) -> tuple[list[dict], list[str]]:
    """Each rank's means per step: blocks, regions, calls by key; and the blocks in the order they first ran."""
    out, order = [], []
    for rp in ranks:
        n = max(len(rp.steps), 1)
        blocks: dict[str, float] = defaultdict(float)
        regions: dict[str, float] = defaultdict(float)
        calls: dict[tuple, dict[str, float]] = {}
        for k, st in enumerate(rp.steps):
            for name, ms in st.compute.items():
                blocks[name] += ms / n
                if name not in order:
                    order.append(name)
            for name, ms in st.regions.items():
                regions[name] += ms / n
            for ci, c in enumerate(st.calls):
                key = (c.block, c.phase, c.module, c.node, c.op)
                agg = calls.setdefault(key, {"ms": 0.0, "wait_ms": 0.0, "calls": 0.0, "bytes": 0, "start": c.start_ms})
                agg["ms"] += c.ms / n
                agg["wait_ms"] += waits.get((rp.rank, k, ci), 0.0) / n
                agg["calls"] += 1 / n
                agg["bytes"] = max(agg["bytes"], c.bytes)
        out.append({"step": _mean([s.step_ms for s in rp.steps]), "other": _mean([s.other_ms for s in rp.steps]),
                    "pipeline": _mean([s.pipeline_ms for s in rp.steps]), "blocks": blocks, "regions": regions,
                    "calls": calls})
    return out, order


def _across(per: list[dict], part: str) -> dict[Any, Any]:
    """Mean over the ranks that have each key of `part` (dict values averaged field by field)."""
    got: dict[Any, list] = defaultdict(list)
    for r in per:
        for key, value in r[part].items():
            got[key].append(value)
    out: dict[Any, Any] = {}
    for key, values in got.items():
        if isinstance(values[0], dict):
            out[key] = {f: (max(v[f] for v in values) if f == "bytes" else _mean([v[f] for v in values]))
                        for f in values[0]}
        else:
            out[key] = _mean(values)
    return out


def _ratio(measured: float, predicted: Optional[float]) -> Optional[float]:
    """measured / predicted, or None without a prediction."""
    return round(measured / predicted, 3) if predicted else None


def _collective(key: tuple, agg: dict, prediction: Any) -> dict[str, Any]:
    """One collective's JSON entry."""
    block, phase, module, node, op = key
    pred = prediction.collective_ms(op, phase, agg["bytes"]) * agg["calls"] if prediction is not None else None
    return {"op": op, "phase": phase, "module": module, "node": node, "ms": round(agg["ms"], 4),
            "wait_ms": round(agg["wait_ms"], 4), "bytes": int(agg["bytes"]), "calls": round(agg["calls"], 3),
            "predicted_ms": None if pred is None else round(pred, 4), "ratio": _ratio(agg["ms"], pred)}


def build_report(ranks: list[Any], prediction: Any = None, **facts: Any) -> "ProfileReport":
    """The report of every rank's RankProfile; `facts` (model, world_size, train, ...) are copied into it."""
    if not ranks or not any(rp.steps for rp in ranks):
        from tpcompile.errors import TPCompileError
        raise TPCompileError("tpcompile.profile: no step ran a profiled module inside the `with` block; run the "
                             "model there (and call prof.step() after each step)")
    waits = _waits(ranks)
    per, order = _per_rank(ranks, waits)
    blocks, regions, calls = _across(per, "blocks"), _across(per, "regions"), _across(per, "calls")
    modules: dict[str, list[str]] = {}
    for rp in ranks:
        for b, paths in getattr(rp, "modules", {}).items():
            modules.setdefault(b, [p for p in paths])
    pred_blocks = prediction.blocks if prediction is not None else {}
    entries = []
    loose = [""] if any(k[0] == "" for k in calls) else []  # torch.distributed calls outside every block and region
    for name in order + [r for r in regions if r not in order] + loose:
        kind = "block" if name in blocks else "region" if name in regions else "outside"
        mine = sorted(((k, v) for k, v in calls.items() if k[0] == name), key=lambda kv: kv[1]["start"])
        colls = [_collective(k, v, prediction) for k, v in mine]
        compute = blocks.get(name, regions.get(name, 0.0))
        pc = pred_blocks.get(name, (None, None))[0] if kind == "block" else \
            (prediction.terms.get("optimizer") if prediction is not None and name == "optimizer" else None)
        shown = _display(name, modules.get(name, [])) if name else "(outside every block and region)"
        entries.append({"module": shown, "block": name, "kind": kind,
                        "compute_ms": round(compute, 4), "predicted_compute_ms": None if pc is None else round(pc, 4),
                        "compute_ratio": _ratio(compute, pc), "comm_ms": round(sum(c["ms"] for c in colls), 4),
                        "wait_ms": round(sum(c["wait_ms"] for c in colls), 4), "collectives": colls})
    data: dict[str, Any] = dict(facts)
    data.update(_totals(per, entries, prediction))
    data["blocks"] = entries
    data["ranks"] = [{"rank": rp.rank, "step_ms": round(p["step"], 4), "steps": len(rp.steps)}
                     for rp, p in zip(ranks, per)]
    return ProfileReport(data)


def _display(name: str, paths: list[str]) -> str:
    """A block's module: a layer's path; for 'pre', 'post' or 'model' the modules its code ran in."""
    if not paths or paths == [name]:
        return name
    shown = [p or "(top level)" for p in paths[:4]]
    return ", ".join(shown) + (f" +{len(paths) - 4} more" if len(paths) > 4 else "")


def _totals(per: list[dict], entries: list[dict], prediction: Any) -> dict[str, Any]:
    """Step figures, the measured terms beside the predicted ones, and the terms off by more than OFF."""
    step = _mean([p["step"] for p in per])
    other = _mean([p["other"] for p in per])
    pipeline = _mean([p["pipeline"] for p in per])
    colls = [c for e in entries for c in e["collectives"]]
    measured = {"compute": sum(e["compute_ms"] for e in entries if e["kind"] == "block"),
                "tp_comm": sum(c["ms"] for c in colls if c["phase"] != "outside"),
                "dp_comm": sum(c["ms"] for c in colls if c["phase"] == "outside" and not _p2p(c["op"])),
                "pp_comm": sum(c["ms"] for c in colls if c["phase"] == "outside" and _p2p(c["op"])),
                "bubble": pipeline,
                "optimizer": sum(e["compute_ms"] for e in entries
                                 if e["kind"] == "region" and e["block"] == "optimizer"),
                "overhead": other + sum(e["compute_ms"] for e in entries
                                        if e["kind"] == "region" and e["block"] != "optimizer")}
    accounted = sum(e["compute_ms"] + e["comm_ms"] for e in entries) + pipeline
    predicted = prediction.terms if prediction is not None else {}
    terms, off = [], []
    for t in TERMS:
        m, p = measured[t], predicted.get(t)
        ratio = _ratio(m, p)
        big = max(m, p or 0.0) >= NOTABLE * max(step, prediction.step_ms if prediction is not None else 0.0)
        bad = prediction is not None and big and (ratio is None or abs(ratio - 1.0) > OFF)
        terms.append({"term": t, "measured_ms": round(m, 4), "predicted_ms": None if p is None else round(p, 4),
                      "ratio": ratio, "off": bad})
        if bad:
            off.append(f"{t}: measured {m:.2f} ms, predicted {p or 0.0:.2f} ms" +
                       (f" ({ratio:.2f}x)" if ratio is not None else " (none predicted)"))
    return {"step_ms": round(step, 4), "predicted_step_ms": round(prediction.step_ms, 4) if prediction else None,
            "step_ratio": _ratio(step, prediction.step_ms if prediction else None),
            "accounted_ms": round(accounted, 4), "other_ms": round(other, 4), "bubble_ms": round(pipeline, 4),
            "wait_ms": round(sum(c["wait_ms"] for c in colls), 4), "terms": terms, "off_terms": off,
            "cluster": prediction.cluster_fields() if prediction is not None else None}


def _p2p(op: str) -> bool:
    """True for torch.distributed's point-to-point ops (a pipeline's sends and receives)."""
    return "send" in op or "recv" in op


@dataclass
class ProfileReport:
    """What `tpcompile profile` prints: `.data` is its JSON object, `.table()` its text, `.save_png()` its chart."""

    data: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        """The JSON object (keys step_ms, predicted_step_ms, blocks, terms, off_terms, ...)."""
        return self.data

    def to_json(self) -> str:
        """The JSON object as one line."""
        return json.dumps(self.data)

    def table(self) -> str:
        """The report as text: per block its compute and collectives beside the prediction, then the terms."""
        from tpcompile.report.profile_table import profile_table
        return profile_table(self.data)

    def save_png(self, path: str | Path) -> Path:
        """A PNG of stacked bars per block (compute, communication, waiting), measured beside predicted."""
        from tpcompile.report.profile_plot import save_png
        return save_png(self.data, Path(path))
