"""The plan as tables: every parameter's split, per-block bytes, and the collectives one forward runs."""
from __future__ import annotations

import io
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from rich import box
from rich.console import Console
from rich.table import Table

from tpcompile.layouts import holder_runs
from tpcompile.ops.collectives import CollectiveEvent
from tpcompile.ops.schedule import FORWARD_COLLECTIVES, collective_op
from tpcompile.passes.pass_context import module_path
from tpcompile.placement import rank_pieces
from tpcompile.report.units import format_bytes as _bytes
from tpcompile.report.wording import replicated_modules, short_reason, short_warning

OUTPUT_BLOCK = "(output)"
ROOT_BLOCK = "(root)"


@dataclass(frozen=True)
class ParamRow:
    """One parameter: names (tied ones joined), split, shapes and bytes on one rank."""

    name: str
    block: str
    split: str
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    itemsize: int

    @property
    def local_bytes(self) -> int:
        return math.prod(self.local_shape) * self.itemsize

    @property
    def global_bytes(self) -> int:
        return math.prod(self.global_shape) * self.itemsize


@dataclass(frozen=True)
class CollectiveRow:
    """One executed collective of rank 0's forward, with the block it belongs to."""

    op: str
    block: str
    nbytes: int  # this rank's input tensor
    shape: tuple[int, ...]


@dataclass
class PlanReport:
    """Everything the plan table shows."""

    title: str
    world_size: int
    params: list[ParamRow] = field(default_factory=list)
    collectives: list[CollectiveRow] = field(default_factory=list)
    backward_only: Counter = field(default_factory=Counter)  # collectives that only act in backward
    replicated: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def split_text(pp: Any) -> str:
    """'column@0 64|64|64', 'row@1', 'vocab@0 padded 252 (63|63|63|61)', 'replicated' for a ParamPlan."""
    if pp.dim is None:
        return "replicated"
    text = f"{pp.role}@{pp.dim}"
    if pp.segments and len(pp.segments) > 1:
        text += " " + "|".join(map(str, pp.segments))
    sl, ws = pp.slice(), pp.world_size
    held = [sum(n for _, _, n in rank_pieces(sl, pp.global_shape[pp.dim], r, ws)) for r in range(ws)]
    if pp.padded:  # and what each rank holds of the real size, the rest zeros: 'padded 64 (16|16|16|0)'
        pads = pp.padded if isinstance(pp.padded, tuple) else (pp.padded,)
        text += f" padded {'+'.join(map(str, pads))} ({'|'.join(map(str, held))})"
    if pp.pieces:
        text += f" {pp.pieces} pieces"
        if ws % pp.pieces:  # held by runs of ranks of different lengths: 'ranks 0-2|3-4' (2 kv heads at 5 ranks)
            runs = holder_runs(ws, pp.pieces)
            text += " ranks " + "|".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)
    if sl.rank_cuts:  # each rank's real part of its one piece: 'cut 16|8|16|8' (a kv group's heads split 2 | 1)
        text += f" cut {'|'.join(map(str, held))}"
    if (pp.padded or sl.rank_cuts) and pp.head and not any(h % pp.head for h in held):  # heads a rank: 'heads 2|2|0'
        text += f" heads {'|'.join(str(h // pp.head) for h in held)}"
    return text


def block_of(path: str) -> str:
    """The block a module belongs to: its parent ('h.0.attn.c_attn' -> 'h.0.attn'); a top-level module is its own."""
    return path.rpartition(".")[0] or path or ROOT_BLOCK


def ring_bytes(op: str, nbytes: int, world_size: int) -> float:
    """Bytes one rank sends for a collective on an input of nbytes, by the ring algorithm."""
    p = world_size
    if op == "all_reduce":
        return 2 * (p - 1) / p * nbytes
    if op in ("all_gather", "all_gather_replicated"):
        return (p - 1) * nbytes
    if op == "reduce_scatter":
        return (p - 1) / p * nbytes
    return 0.0


def _tensor(root: Any, path: str) -> Any:
    """The tensor at a dotted attribute path."""
    for part in path.split("."):
        root = getattr(root, part)
    return root


def plan_report(sharded: Any, events: Optional[Sequence[CollectiveEvent]], title: str) -> PlanReport:
    """Collect the rows from a ShardedModel and the collectives rank 0 ran in one forward.

    Without `events` (no forward was run) the collectives are rank 0's forward collective
    nodes, with their bytes unknown (0).
    """
    plan = sharded.plan
    report = PlanReport(title, sharded.world_size, replicated=dict(plan.replicated), warnings=list(plan.warnings))
    owners = {name.rpartition(".")[0] for name in plan.parameters}
    # a module holding parameters of its own beside submodules with theirs (nn.MultiheadAttention:
    # in_proj_weight next to out_proj) is a block itself, not a part of its parent's
    containers = {o for o in owners if o and any(x.startswith(o + ".") for x in owners)}
    for name, pp in plan.parameters.items():
        label = " = ".join((name, *pp.tied))
        item = _tensor(sharded.captured, name).element_size()
        owner = name.rpartition(".")[0]
        report.params.append(ParamRow(label, owner if owner in containers else block_of(owner), split_text(pp),
                                      tuple(pp.global_shape), tuple(pp.local_shape), item))
    blocks = {p.block for p in report.params}
    nodes = [n for n in sharded.rank(0).graph.nodes if collective_op(n) is not None]
    talking = [n for n in nodes if collective_op(n) in FORWARD_COLLECTIVES]
    if events is None:
        events = [CollectiveEvent(collective_op(n), "forward", 0, 0, ()) for n in talking]
    # The graph runs in node order, so the k-th event is the k-th communicating node, when the ops agree.
    agree = [collective_op(n) for n in talking] == [e.op for e in events]
    for k, e in enumerate(events):
        where = module_path(talking[k]) if agree else ""
        # a collective issued by a block's own code (MultiheadAttention's out projection) belongs to that block
        block = (where if where in blocks else block_of(where)) if where else OUTPUT_BLOCK
        report.collectives.append(CollectiveRow(e.op, block, e.nbytes, e.shape))
    report.backward_only = Counter(collective_op(n) for n in nodes if collective_op(n) not in FORWARD_COLLECTIVES)
    return report


def _shape(shape: Sequence[int]) -> str:
    return "x".join(map(str, shape)) or "scalar"


def param_table(r: PlanReport) -> Table:
    """Every parameter: split, global and per-rank shape, bytes per rank."""
    t = Table(title="parameters", box=box.SIMPLE_HEAD, show_edge=False, title_justify="left")
    for col, just in (("parameter", "left"), ("split", "left"), ("global", "right"), ("per rank", "right"),
                      ("bytes per rank", "right")):
        t.add_column(col, justify=just)
    for p in r.params:
        t.add_row(p.name, p.split, _shape(p.global_shape), _shape(p.local_shape), _bytes(p.local_bytes))
    return t


def block_table(r: PlanReport) -> Table:
    """Per block: how its parameters are split, bytes per rank, and its forward collectives."""
    t = Table(title="blocks", box=box.SIMPLE_HEAD, show_edge=False, title_justify="left")
    for col, just in (("block", "left"), ("splits", "left"), ("bytes per rank", "right"), ("of whole", "right"),
                      ("forward collectives", "left")):
        t.add_column(col, justify=just)
    blocks: dict[str, list[ParamRow]] = {}
    for p in r.params:
        blocks.setdefault(p.block, []).append(p)
    for c in r.collectives:
        blocks.setdefault(c.block, [])
    for block, params in blocks.items():
        kinds: dict[str, str] = {}
        for p in params:  # one entry per module: 'c_attn column' (its weight's split)
            owner = p.name.split(" = ")[0].rpartition(".")[0].rpartition(".")[2] or p.name
            kinds.setdefault(owner, p.split.split("@")[0])
        splits = ", ".join(f"{m} {k}" for m, k in kinds.items() if k != "replicated")
        local = sum(p.local_bytes for p in params)
        whole = sum(p.global_bytes for p in params)
        ops = Counter(c.op for c in r.collectives if c.block == block)
        t.add_row(block, (splits or "replicated") if params else "-", _bytes(local) if params else "-",
                  f"{100 * local / whole:.0f}%" if whole else "-", ", ".join(f"{v} {k}" for k, v in ops.items()) or "-")
    return t


def collective_table(r: PlanReport) -> Table:
    """Per collective op: how many one forward runs, bytes in, and estimated bytes sent per rank."""
    t = Table(title="collectives per forward (rank 0, counted in a simulated forward)", box=box.SIMPLE_HEAD,
              show_edge=False, title_justify="left")
    for col, just in (("collective", "left"), ("count", "right"), ("input shape", "left"),
                      ("input bytes", "right"), ("est. bytes sent (ring)", "right")):
        t.add_column(col, justify=just)
    groups: dict[tuple[str, tuple], list[CollectiveRow]] = {}
    for c in r.collectives:
        groups.setdefault((c.op, c.shape), []).append(c)
    for (op, shape), rows in groups.items():
        n = sum(c.nbytes for c in rows)
        t.add_row(op, str(len(rows)), _shape(shape), _bytes(n),
                  _bytes(sum(ring_bytes(op, c.nbytes, r.world_size) for c in rows)))
    if not groups:
        t.add_row("none", "0", "-", "0 B", "0 B")
    return t


def warning_lines(r: PlanReport, *, full: bool = False) -> list[str]:
    """One line per replicated module with its reason in words, then the warnings no such line covers.

    With `full`, every reason and warning as propagation wrote it (the command line's --debug).
    """
    if full:
        return [f"replicated {m}: {why}" for m, why in r.replicated.items()] + [f"warning: {w}" for w in r.warnings]
    lines = [f"replicated {m}: {short_reason(why)}" for m, why in r.replicated.items()]
    covered = set(r.replicated)
    for w in r.warnings:
        mods = replicated_modules(w)
        if not mods or not set(mods) <= covered:
            lines.append(f"warning: {short_warning(w)}")
    return lines


def summary_lines(r: PlanReport, inputs: Optional[str] = None, *, full_warnings: bool = False) -> list[str]:
    """Totals under the tables: parameter bytes, communication bytes, replicated regions, warnings."""
    local = sum(p.local_bytes for p in r.params)
    whole = sum(p.global_bytes for p in r.params)
    moved = sum(c.nbytes for c in r.collectives)
    sent = sum(ring_bytes(c.op, c.nbytes, r.world_size) for c in r.collectives)
    lines = [f"parameters per rank: {_bytes(local)} of {_bytes(whole)} ({100 * local / max(whole, 1):.1f}%)",
             f"communication per forward per rank: {len(r.collectives)} collectives, {_bytes(moved)} in, "
             f"about {_bytes(sent)} sent by a ring implementation"
             + (f" (inputs {inputs})" if inputs else "")]
    if r.backward_only:
        listed = ", ".join(f"{v} {k}" for k, v in r.backward_only.items())
        lines.append(f"backward-only markers in the graph (they communicate in backward): {listed}")
    return lines + warning_lines(r, full=full_warnings)


def print_plan(r: PlanReport, console: Console, inputs: Optional[str] = None, *, full_warnings: bool = False) -> None:
    """Print the title, the three tables and the totals (warnings in full with `full_warnings`)."""
    console.print(r.title, style="bold", highlight=False, markup=False)
    for table in (param_table(r), block_table(r), collective_table(r)):
        console.print()
        console.print(table)
    console.print()
    for line in summary_lines(r, inputs, full_warnings=full_warnings):
        console.print(line, highlight=False, markup=False, soft_wrap=True)


def summary_text(sharded: Any, width: int = 110) -> str:
    """ShardedModel.summary(): the parameter and block tables and the totals, as plain text.

    No forward runs, so the collectives are counted from rank 0's graph and their bytes are left
    out; `tpcompile plan` runs one forward and shows them.
    """
    r = plan_report(sharded, None, f"tpcompile plan: {sharded.model_name} at world size {sharded.world_size}")
    console = Console(file=io.StringIO(), width=width, color_system=None, force_terminal=False)
    console.print(r.title, highlight=False, markup=False)
    for table in (param_table(r), block_table(r)):
        console.print()
        console.print(table)
    console.print()
    counts = Counter(c.op for c in r.collectives)
    lines = [line for line in summary_lines(r) if not line.startswith("communication per forward")]
    lines.insert(1, "forward collectives per rank: " + (", ".join(f"{v} {k}" for k, v in counts.items()) or "none"))
    for line in lines:
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    return "\n".join(line.rstrip() for line in console.file.getvalue().rstrip().splitlines())
