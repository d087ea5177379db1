"""One rank's torch.profiler events read as steps: each block's compute, each collective call, the user's regions.

Every profiled interval goes to its nearest labelled enclosing event, so the parts of a step add up
to the step exactly: a block region (forward), a collective region (forward) or a collective op
inside backward, a region of the user's loop, a pipeline action of torch's schedules (what of it no
block covers is the pipeline's waiting), or the step itself ("other": what no label covers, such
as the loop's own Python). Backward runs outside the graph, so autograd's `evaluate_function`
events are labelled by the forward op that made them (the profiler gives both the same sequence
number): their time goes to that op's block or region, and a collective op they call is that
forward collective's backward, named by its module path.
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

from tpcompile.runtime.profiler_marks import BLOCK, COLLECTIVE, PIPELINE, REGION, STEP, parse_collective

__all__ = ["Call", "Event", "StepRecord", "call_labels", "compact", "read_steps"]

BACKWARD = "autograd::engine::evaluate_function: "
OPS = "tpcompile::"
_PIPELINE = re.compile(r"^(Forward|Backward) \d+$|^PP:")
# per-rank input bytes of the backward collective, as a multiple of the forward input's (p: the group's size)
_BACKWARD_SCALE = {"all_gather": "p", "reduce_scatter": "1/p", "scatter": "1/p"}
# collectives that exchange nothing in forward (their backward does)
SILENT_FORWARD = frozenset({"grad_all_reduce", "scatter", "grad_bucket_all_reduce", "grad_piece_all_reduce",
                            "linears_grad_all_reduce"})
_C10D = {"c10d::allreduce_": "all_reduce", "c10d::allgather_": "all_gather", "c10d::_allgather_base_": "all_gather",
         "c10d::reduce_scatter_": "reduce_scatter", "c10d::_reduce_scatter_base_": "reduce_scatter"}


class Event(NamedTuple):
    """One profiler event: name, thread, sequence number, forward thread, start and end (us), parent index."""

    name: str
    thread: int
    seq: int
    fwd_thread: int
    start: float
    end: float
    parent: int


@dataclass
class Call:
    """One collective call on one rank in one step."""

    op: str
    phase: str  # forward | backward | outside (a torch.distributed call of no tpcompile collective)
    module: str
    node: str
    block: str
    bytes: int
    ms: float
    start_ms: float  # from the step's start (the ranks leave a barrier together just before it)
    index: int = 0  # the how-manyth call of this (phase, node) in the step


@dataclass
class StepRecord:
    """One step on one rank: its time and where it went (milliseconds)."""

    step_ms: float
    other_ms: float
    compute: dict[str, float] = field(default_factory=dict)  # block -> its time outside collectives
    regions: dict[str, float] = field(default_factory=dict)  # a region of the user's loop -> its time
    calls: list[Call] = field(default_factory=list)
    pipeline_ms: float = 0.0

    @property
    def empty(self) -> bool:
        """True when nothing of the model ran in the step (the one a last step() call opened)."""
        return not (self.compute or self.regions or self.calls)


def compact(events: Any) -> list[Event]:
    """torch.profiler's FunctionEvents as plain tuples (picklable, small), parents by index."""
    index = {id(e): i for i, e in enumerate(events)}
    out = []
    for e in events:
        parent = index.get(id(e.cpu_parent), -1) if e.cpu_parent is not None else -1
        out.append(Event(e.name, int(e.thread), int(e.sequence_nr), int(e.fwd_thread or 0),
                         float(e.time_range.start), float(e.time_range.end), parent))
    return out


def _ancestors(events: list[Event], i: int) -> list[int]:
    """Indices of event i's enclosing events, innermost first."""
    out = []
    p = events[i].parent
    while p >= 0:
        out.append(p)
        p = events[p].parent
    return out


def read_steps(events: list[Event], group_size: int) -> list[StepRecord]:
    """Every step region's record, in order."""
    steps = sorted((i for i, e in enumerate(events) if e.name.startswith(STEP)), key=lambda i: events[i].start)
    return [_read_step(events, s, group_size) for s in steps]


def _label_forward(events: list[Event], inside: list[int]) -> tuple[dict[int, tuple], dict[tuple, tuple]]:
    """Labels of the forward's events (index -> label) and forward op (thread, seq) -> label of its region."""
    labels: dict[int, tuple] = {}
    for i in inside:
        name = events[i].name
        if name.startswith(BLOCK):
            labels[i] = ("block", name[len(BLOCK):])
        elif name.startswith(REGION):
            labels[i] = ("region", name[len(REGION):])
        elif name.startswith(COLLECTIVE):
            labels[i] = ("call", parse_collective(name) or {"op": "?", "module": "", "node": "", "bytes": 0})
        elif name.startswith(PIPELINE) or _PIPELINE.match(name):
            labels[i] = ("pipeline", name)
    for i, lab in list(labels.items()):
        if lab[0] == "call":
            labels[i] = ("call", {**lab[1], "block": _block_of(events, i, labels), "phase": "forward"})
    made: dict[tuple, tuple] = {}
    for i in inside:
        e = events[i]
        if e.seq < 0 or e.name.startswith(BACKWARD):
            continue
        chain = _ancestors(events, i)
        if any(events[a].name.startswith(BACKWARD) for a in chain):
            continue
        near = next((labels[a] for a in chain if a in labels and labels[a][0] != "pipeline"), None)
        if near is not None:
            made.setdefault((e.thread, e.seq), near)
    return labels, made


def _block_of(events: list[Event], i: int, labels: dict[int, tuple]) -> str:
    """The block or region enclosing event i ('' when none)."""
    for a in _ancestors(events, i):
        kind, what = labels.get(a, (None, None))
        if kind in ("block", "region"):
            return what
        if kind == "call":
            return what.get("block", "")
    return ""


def _read_step(events: list[Event], s: int, group_size: int) -> StepRecord:
    """One step's record from the events inside step region s."""
    inside, labels = _step_labels(events, s, group_size)
    return _assemble(events, s, inside, labels)


def call_labels(events: list[Event], group_size: int) -> dict[int, dict[str, Any]]:
    """Event index -> the collective call it is (op, phase, module, node, bytes, block), over every step."""
    out: dict[int, dict[str, Any]] = {}
    for s in (i for i, e in enumerate(events) if e.name.startswith(STEP)):
        _, labels = _step_labels(events, s, group_size)
        out.update({i: what for i, (kind, what) in labels.items() if kind == "call"})
    return out


def _step_labels(events: list[Event], s: int, group_size: int) -> tuple[list[int], dict[int, tuple]]:
    """The events inside step region s, and the label of each labelled one."""
    root = events[s]
    inside = [i for i, e in enumerate(events) if i != s and e.start >= root.start and e.end <= root.end]
    labels, made = _label_forward(events, inside)
    children: dict[int, list[int]] = defaultdict(list)
    for i in sorted(inside, key=lambda k: events[k].start):
        children[events[i].parent].append(i)
    # backward: evaluate_function events take the label of the forward op that made them
    previous: Optional[tuple] = None
    for i in sorted(inside, key=lambda k: events[k].start):
        e = events[i]
        if not e.name.startswith(BACKWARD) or any(events[a].name.startswith(BACKWARD) for a in _ancestors(events, i)):
            continue
        lab = made.get((e.fwd_thread, e.seq)) or made.get((e.thread, e.seq)) or previous
        if lab is None:
            continue
        previous = lab
        if lab[0] == "call":
            info = lab[1]
            labels[i] = ("block", info.get("block", ""))
            inner = _inner_collective(events, children, i)
            if inner is not None:
                k, op = inner
                labels[k] = ("call", {**info, "op": op, "phase": "backward",
                                      "bytes": _backward_bytes(info, group_size)})
        else:
            labels[i] = lab
    for i in inside:  # torch.distributed's own calls (data-parallel, pipeline sends) outside tpcompile's
        name = events[i].name
        if name.startswith("c10d::") and not any(labels.get(a, ("",))[0] == "call" or
                                                 events[a].name.startswith(("c10d::", OPS))
                                                 for a in _ancestors(events, i)):
            labels[i] = ("call", {"op": name, "module": "", "node": "", "bytes": 0, "phase": "outside",
                                  "block": _block_of(events, i, labels)})
    return inside, labels


def _inner_collective(events: list[Event], children: dict[int, list[int]], i: int) -> Optional[tuple[int, str]]:
    """The first communicating op inside backward event i (a tpcompile op before torch.distributed's), and its
    collective's name; None when it communicates nothing (all_reduce's backward is the identity)."""
    found: Optional[tuple[int, str]] = None
    todo = list(children.get(i, ()))
    while todo:
        k = todo.pop(0)
        name = events[k].name
        if name.startswith(OPS):
            return k, name[len(OPS):]
        if name.startswith("c10d::") and found is None:
            found = (k, _C10D.get(name, name))
        todo.extend(children.get(k, ()))
    return found


def _backward_bytes(info: dict[str, Any], p: int) -> int:
    """Per-rank input bytes of a forward collective's backward collective."""
    scale = _BACKWARD_SCALE.get(info["op"])
    n = info["bytes"]
    return n * p if scale == "p" else n // max(p, 1) if scale == "1/p" else n


def _assemble(events: list[Event], s: int, inside: list[int], labels: dict[int, tuple]) -> StepRecord:
    """Self times of every labelled event summed by label: the step's record."""
    root = events[s]
    own = {i: events[i].end - events[i].start for i in labels}
    own[s] = root.end - root.start
    for i in labels:
        near = next((a for a in _ancestors(events, i) if a in labels or a == s), None)
        if near is not None:
            own[near] -= events[i].end - events[i].start
    record = StepRecord((root.end - root.start) / 1e3, own[s] / 1e3)
    compute: dict[str, float] = defaultdict(float)
    regions: dict[str, float] = defaultdict(float)
    seen: dict[tuple, int] = defaultdict(int)
    for i in sorted(labels, key=lambda k: events[k].start):
        kind, what = labels[i]
        if kind == "block":
            compute[what] += own[i] / 1e3
        elif kind == "region":
            regions[what] += own[i] / 1e3
        elif kind == "pipeline":
            record.pipeline_ms += own[i] / 1e3
        elif what["phase"] == "forward" and what["op"] in SILENT_FORWARD:
            compute[what["block"]] += own[i] / 1e3  # no exchange: the op is part of its block's compute
        else:
            key = (what["phase"], what["node"] or what["op"])
            record.calls.append(Call(what["op"], what["phase"], what["module"], what["node"], what.get("block", ""),
                                     int(what["bytes"]), own[i] / 1e3, (events[i].start - root.start) / 1e3,
                                     seen[key]))
            seen[key] += 1
    record.compute, record.regions = dict(compute), dict(regions)
    return record
