"""Profiled ranks as one Chrome trace (chrome://tracing, Perfetto): a process per rank, the steps lined up.

Every event of a rank becomes a complete event ("ph": "X") of process `rank`. Times are shifted so
that each rank's first step starts at the same moment (the ranks leave a barrier together just
before it). Every event of a collective call (tpcompile's region, its op, the torch.distributed
call inside, and in backward the op that autograd runs for it) carries the call's op, phase,
module path, node and bytes in its `args`.
"""
from __future__ import annotations

from typing import Any

from tpcompile.runtime.profiler_events import Event, call_labels
from tpcompile.runtime.profiler_marks import STEP, parse_collective


def _call_of(events: list[Event], labels: dict[int, dict], i: int) -> dict | None:
    """The collective call event i belongs to (its own label or an enclosing one's), or None."""
    k = i
    while k >= 0:
        if k in labels:
            return labels[k]
        found = parse_collective(events[k].name)  # a call outside every step (a warm-up under the profiler)
        if found is not None:
            return {**found, "phase": "forward"}
        k = events[k].parent
    return None


def chrome_trace(ranks: list[Any]) -> dict[str, Any]:
    """The trace of every RankProfile's events, one process per rank."""
    out: list[dict[str, Any]] = []
    for rp in ranks:
        events: list[Event] = rp.events
        starts = [e.start for e in events if e.name.startswith(STEP)]
        zero = min(starts) if starts else min((e.start for e in events), default=0.0)
        labels = call_labels(events, len(rp.peers))
        out.append({"name": "process_name", "ph": "M", "pid": rp.rank, "args": {"name": f"rank {rp.rank}"}})
        for i, e in enumerate(events):
            item: dict[str, Any] = {"name": e.name, "ph": "X", "pid": rp.rank, "tid": e.thread, "cat": "cpu_op",
                                    "ts": round(e.start - zero, 3), "dur": round(max(e.end - e.start, 0.0), 3)}
            call = _call_of(events, labels, i)
            if call is not None:
                item["cat"] = "collective"
                item["args"] = {k: call.get(k) for k in ("op", "phase", "module", "node", "bytes", "block")}
            elif e.seq >= 0:
                item["args"] = {"sequence": e.seq}
            out.append(item)
    return {"traceEvents": out, "displayTimeUnit": "ms"}
