"""Strategy.table(): the choice, where its step time goes, the alternatives beside it, and the per-unit decisions."""
from __future__ import annotations

import io
from collections import Counter
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from tpcompile.report.units import format_bytes
from tpcompile.strategy.quantities import format_seconds

WIDTH = 150


def _layout(tp: int, dp: int, pp: int) -> str:
    return f"tp {tp} x dp {dp} x pp {pp}"


def _options(recompute: bool, sp: bool, kind: str, dp: int) -> str:
    words = [kind if dp > 1 else "-"]
    if sp:
        words.append("seq-par")
    if recompute:
        words.append("recompute")
    return ", ".join(words)


def render(s: Any, top: int) -> str:
    """The whole report of `s`, a strategy.record.Strategy (the record imports this module), as text."""
    out = io.StringIO()
    console = Console(file=out, width=WIDTH, color_system=None, force_terminal=False, highlight=False)
    c = s.cluster
    tokens = s.global_batch * s.seq_len
    console.print(f"tpcompile strategy: {s.model}, global batch {s.global_batch} x {s.seq_len} tokens "
                  f"({'training' if s.training else 'inference'})")
    console.print(f"cluster: {c.describe()}")
    console.print(f"chosen: {_layout(s.tp, s.dp, s.pp)}, {s.microbatches} microbatch"
                  f"{'es' * (s.microbatches != 1)} of {s.micro_batch_size}, {_options(s.recompute, s.sequence_parallel, s.data_parallel, s.dp)}; "
                  f"predicted step {format_seconds(s.predicted_step_s)} ({tokens / s.predicted_step_s / c.gpus:,.0f} "
                  f"tokens/s per GPU), {format_bytes(s.memory_per_gpu_bytes)} per GPU of "
                  f"{format_bytes(c.usable_memory)} usable")
    parts = ", ".join(f"{k} {format_seconds(v)}" for k, v in s.time_breakdown.items() if v > 0)
    console.print(f"step time: {parts}")
    mem = ", ".join(f"{k} {format_bytes(v)}" for k, v in s.memory_breakdown.items() if v > 0)
    console.print(f"memory per GPU: {mem}")
    comm = ", ".join(f"{k} {format_bytes(v)}" for k, v in s.comm_per_step.items() if v > 0) or "none"
    console.print(f"communication per GPU and step: {comm}")
    if s.pp > 1:
        console.print("pipeline stages: " + "; ".join(f"{a}..{b}" if a != b else a for a, b in s.stages))
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, title=None)
    for name, just in (("layout", "left"), ("microbatches", "right"), ("options", "left"), ("step", "right"),
                       ("tokens/s/GPU", "right"), ("memory/GPU", "right"), ("why not chosen", "left")):
        table.add_column(name, justify=just)  # type: ignore[arg-type]
    table.add_row(_layout(s.tp, s.dp, s.pp) + " *", f"{s.microbatches} x {s.micro_batch_size}",
                  _options(s.recompute, s.sequence_parallel, s.data_parallel, s.dp),
                  format_seconds(s.predicted_step_s), f"{tokens / s.predicted_step_s / c.gpus:,.0f}",
                  format_bytes(s.memory_per_gpu_bytes), "chosen")
    for a in s.alternatives[:top]:
        size = s.global_batch // (a.dp * a.microbatches)
        table.add_row(_layout(a.tp, a.dp, a.pp), f"{a.microbatches} x {size}",
                      _options(a.recompute, a.sequence_parallel, a.data_parallel, a.dp),
                      format_seconds(a.predicted_step_s), f"{tokens / a.predicted_step_s / c.gpus:,.0f}",
                      format_bytes(a.memory_per_gpu_bytes), a.why_lost)
    console.print(table)
    if s.tp > 1 and s.decisions:
        _decisions(console, s)
    for note in s.notes:
        console.print(f"note: {note}")
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines()) + "\n"


def _decisions(console: Console, s: Any) -> None:
    """Per-unit split or replicate, identical units of repeated layers counted once."""
    console.print(f"per-unit decisions at tp {s.tp} ({sum(d.split for d in s.decisions)} split, "
                  f"{sum(not d.split for d in s.decisions)} whole):")
    shapes: Counter = Counter()
    first: dict[tuple, str] = {}
    for d in s.decisions:
        key = (_generic(d.unit), d.split, d.why.split(":")[0])
        shapes[key] += 1
        first.setdefault(key, d.unit + ": " + d.why)
    for key, count in shapes.items():
        more = f" (and {count - 1} more like it)" if count > 1 else ""
        console.print(f"  {first[key]}{more}")


def _generic(unit: str) -> str:
    """'model.layers.7.mlp' -> 'model.layers.*.mlp': units of repeated layers read as one."""
    return ".".join("*" if part.isdigit() else part for part in unit.split("."))
