"""The profile report as text: one row per block and per collective, the prediction and the ratio beside each."""
from __future__ import annotations

from typing import Any, Optional

from tpcompile.report.units import format_bytes


def _num(value: Optional[float]) -> str:
    """'12.34', or '-' for no value."""
    return "-" if value is None else f"{value:.2f}"


def _x(value: Optional[float]) -> str:
    """'1.25x', or '-' for no ratio."""
    return "-" if value is None else f"{value:.2f}x"


def profile_table(data: dict[str, Any]) -> str:
    """Blocks, their collectives, the totals and the cost-model terms, as aligned text."""
    head = f"tpcompile profile: {data.get('model', 'model')}"
    if data.get("world_size"):
        head += f" at world size {data['world_size']}"
    head += f", {'training' if data.get('train') else 'forward only'}"
    if data.get("steps_profiled"):
        head += f", mean of {data['steps_profiled']} steps per rank"
    lines = [head]
    step = f"step {data['step_ms']:.2f} ms measured"
    if data.get("unprofiled_step_ms"):
        step += f" ({data['unprofiled_step_ms']:.2f} ms without the profiler)"
    if data.get("predicted_step_ms") is not None:
        step += f", {data['predicted_step_ms']:.2f} ms predicted ({_x(data.get('step_ratio'))})"
    lines += [step, ""]
    rows = [("block / collective", "ms", "predicted", "ratio", "wait ms", "bytes")]
    for b in data["blocks"]:
        label = {"block": f"{b['module']} compute", "region": f"{b['module']} (region of the loop)"}.get(b["kind"],
                                                                                                       b["module"])
        rows.append((label, _num(b["compute_ms"]),
                     _num(b.get("predicted_compute_ms")), _x(b.get("compute_ratio")), "", ""))
        for c in b["collectives"]:
            where = c["module"] or b["module"]
            rows.append((f"  {c['op']} ({c['phase']}) {where}", _num(c["ms"]), _num(c.get("predicted_ms")),
                         _x(c.get("ratio")), _num(c["wait_ms"]), format_bytes(c["bytes"]) if c["bytes"] else "-"))
    if data.get("bubble_ms"):
        rows.append(("pipeline waiting (bubble)", _num(data["bubble_ms"]), "", "", "", ""))
    rows.append(("other (outside every block and region)", _num(data["other_ms"]), "", "", "", ""))
    rows.append(("step", _num(data["step_ms"]), _num(data.get("predicted_step_ms")), _x(data.get("step_ratio")),
                 _num(data.get("wait_ms")), ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for k, r in enumerate(rows):
        cells = (r[0].ljust(widths[0]) if i == 0 else r[i].rjust(widths[i]) for i in range(len(r)))
        lines.append("  ".join(cells).rstrip())
        if k == 0:
            lines.append("-" * (sum(widths) + 2 * (len(widths) - 1)))
    covered = 100.0 * data["accounted_ms"] / data["step_ms"] if data["step_ms"] else 0.0
    lines += ["", f"blocks, collectives and regions: {data['accounted_ms']:.2f} ms of the {data['step_ms']:.2f} ms "
                  f"step ({covered:.0f}%)", "", "cost-model terms (measured / predicted ms):"]
    for t in data["terms"]:
        if t["measured_ms"] or t["predicted_ms"]:
            flag = "  off by more than 25%" if t["off"] else ""
            lines.append(f"  {t['term']:<10} {t['measured_ms']:>9.2f} / {_num(t['predicted_ms']):>9}  "
                         f"{_x(t['ratio']):>7}{flag}")
    if data.get("off_terms"):
        lines += ["", "off by more than 25%: " + "; ".join(data["off_terms"])]
    if data.get("predicted_on"):
        lines.append(f"predicted on {data['predicted_on']}")
    return "\n".join(lines) + "\n"
