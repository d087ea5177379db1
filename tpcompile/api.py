"""shard() and ShardedModel: the public entry point and what it returns."""
from __future__ import annotations

import difflib
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from torch import nn
from torch.fx import GraphModule

from tpcompile.capture import Captured, capture
from tpcompile.collectives import register_group
from tpcompile.errors import TPCompileError
from tpcompile.passes.annotate import annotate_pass
from tpcompile.passes.context import PLAN_VALUES, PassContext, module_path, owner_path
from tpcompile.passes.propagate import propagate_pass, seed_path
from tpcompile.passes.rewrite import rewrite_graph, rewrite_pass
from tpcompile.passes.verify import collective_signature, verify_pass, verify_rank
from tpcompile.placement import slice_shape
from tpcompile.plan_file import PlanFile, load_plan
from tpcompile.sharding_rules.context import ParamSlice

log = logging.getLogger("tpcompile")
FORWARD_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_gather_replicated")


@dataclass(frozen=True)
class ParamPlan:
    """What one parameter became: its split, and its global and per-rank shapes."""

    name: str
    role: str  # column | row | vocab | replicated
    dim: Optional[int]
    segments: Optional[tuple[int, ...]]
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    tied: tuple[str, ...] = ()  # other names of the same parameter
    padded: Optional[int] = None  # split as if zero-padded to this size along dim
    pieces: Optional[int] = None  # split into this many pieces, each shared by world_size/pieces ranks

    def slice(self) -> Optional[ParamSlice]:
        """How the parameter is cut (tpcompile.placement.rank_pieces, rewrite.local_tensor; None: whole)."""
        return None if self.dim is None else ParamSlice(self.dim, self.segments, self.padded, self.pieces)


@dataclass
class Plan:
    """Every decision: per weight-owning module its role, per parameter its split."""

    world_size: int
    modules: dict[str, str] = field(default_factory=dict)
    parameters: dict[str, ParamPlan] = field(default_factory=dict)
    replicated: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def __getitem__(self, module: str) -> str:
        return self.modules[module]


class ShardedModel:
    """One torch.fx GraphModule per rank, built on first use, plus the plan behind them."""

    def __init__(self, captured: GraphModule, ctx: PassContext, model_name: str) -> None:
        self.captured = captured
        self.world_size = ctx.world_size
        self.model_name = model_name
        self._ctx = ctx
        self._ranks: dict[int, GraphModule] = {}
        self._reference: Optional[list] = None
        self._lock = threading.Lock()
        self.plan = _make_plan(captured, ctx)
        self.timings: dict[str, float] = {}  # seconds: capture_s (torch.export), passes_s

    def rank(self, r: int) -> GraphModule:
        """Rank r's GraphModule: the model's arguments in, the model's output structure out."""
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < self.world_size:
            kind = "" if isinstance(r, int) and not isinstance(r, bool) else f" ({type(r).__name__}, not an int)"
            raise TPCompileError(f"rank {r!r}{kind} is out of range for world size {self.world_size}; "
                                 f"ranks are the ints 0 to {self.world_size - 1}")
        with self._lock:  # ranks may be asked for from several threads at once
            if r not in self._ranks:
                log.info("building rank %d of %d", r, self.world_size)
                gm = rewrite_pass(self.captured, self._ctx, r)  # rewrite: this rank's graph
                if self._reference is None:  # rank 0's schedule, even in a process that builds only rank r
                    self._reference = collective_signature(
                        gm if r == 0 else rewrite_graph(self.captured, self._ctx, 0))
                shapes = {name: pp.local_shape for name, pp in self.plan.parameters.items()}
                verify_rank(gm, self._reference, r, shapes)  # verify: lint, planned slices, rank 0's collectives
                self._ranks[r] = gm
            return self._ranks[r]

    def __getitem__(self, r: int) -> GraphModule:
        return self.rank(r)

    def __len__(self) -> int:
        return self.world_size

    def __iter__(self) -> Iterator[GraphModule]:
        return (self.rank(r) for r in range(self.world_size))

    def collectives(self, *, forward_only: bool = True) -> list[tuple[str, str]]:
        """(op, module path) of each collective node in a rank's graph, in order."""
        out = []
        for n in self.rank(0).graph.nodes:
            if n.op == "call_function" and getattr(n.target, "namespace", None) == "tpcompile":
                op = n.target._opname
                if op in FORWARD_COLLECTIVES or not forward_only:
                    out.append((op, module_path(n)))
        return out

    def merge_state_dicts(self, states: list[dict], *, strict: bool = True) -> dict:
        """The original model's state dict, put together from every rank's `state_dict()`."""
        from tpcompile.checkpoint import merge_state_dicts
        return merge_state_dicts(self, states, strict=strict)

    def summary(self) -> str:
        """A readable table of the plan, bytes per rank and the forward collectives."""
        p = self.plan
        rows = [f"tpcompile plan for {self.model_name} at world size {self.world_size}", ""]
        label = {k: k + "".join(f" = {t}" for t in pp.tied) for k, pp in p.parameters.items()}
        width = max([len(v) for v in label.values()] + [9])
        rows.append(f"{'parameter':<{width}}  {'split':<18} {'global':<14} {'per rank':<14}")
        for name, pp in p.parameters.items():
            split = pp.role if pp.dim is None else f"{pp.role}@{pp.dim}"
            split += "" if not pp.segments else f" {'|'.join(map(str, pp.segments))}"
            rows.append(f"{label[name]:<{width}}  {split:<18} {str(list(pp.global_shape)):<14} {str(list(pp.local_shape)):<14}")
        total = sum(math.prod(pp.global_shape) for pp in p.parameters.values())
        local = sum(math.prod(pp.local_shape) for pp in p.parameters.values())
        rows += ["", f"parameters per rank: {local:,} of {total:,} ({100.0 * local / max(total, 1):.1f}%)"]
        counts: dict[str, int] = {}
        for op, _ in self.collectives():
            counts[op] = counts.get(op, 0) + 1
        rows.append("forward collectives per rank: " + (", ".join(f"{v} {k}" for k, v in counts.items()) or "none"))
        for why in p.warnings:
            rows.append(f"warning: {why}")
        return "\n".join(rows)

    def __repr__(self) -> str:
        return f"ShardedModel({self.model_name}, world_size={self.world_size})"


def _make_plan(gm: GraphModule, ctx: PassContext) -> Plan:
    plan = Plan(ctx.world_size, warnings=list(ctx.warnings))
    for node in gm.graph.nodes:
        layout = node.meta.get("tp_layout")
        spec = node.meta.get("tp_rule")
        if layout is None or spec is None or spec.rule not in ("weight_matmul", "embedding"):
            continue
        path = seed_path(node)
        if path is not None:
            plan.modules[path] = layout.role if layout.role in ("column", "row", "vocab") else "replicated"
    for seed, why in ctx.demoted.items():
        if seed_path(seed) is not None:
            plan.replicated[seed_path(seed)] = why
    seen: set[int] = set()
    for name, t in ctx.tensors.items():
        if not isinstance(t, nn.Parameter) or id(t) in seen:
            continue
        seen.add(id(t))
        sl = ctx.slice_for(name)
        owners = [owner_path(n) for n in ctx.aliases(name)]
        roles = [plan.modules[o] for o in owners if o in plan.modules]
        role = next((r for r in roles if r != "replicated"), "replicated") if sl is not None else "replicated"
        local = slice_shape(t.shape, sl, ctx.world_size)
        tied = tuple(n for n in ctx.aliases(name) if n != name)
        plan.parameters[name] = ParamPlan(name, role, None if sl is None else sl.dim,
                                          None if sl is None else sl.segments, tuple(t.shape), local, tied,
                                          None if sl is None else sl.padded, None if sl is None else sl.groups)
    return plan


def _check_plan(plan: Any, paths: set[str]) -> dict[str, str]:
    """The plan as a dict, read from a YAML file when given a path; every key a module of the model."""
    if plan is None:
        return {}
    if isinstance(plan, (str, os.PathLike)):
        plan = load_plan(plan)
    if not isinstance(plan, dict):
        raise TPCompileError(f"plan must be a dict of module path -> one of {', '.join(PLAN_VALUES)}, or the path "
                             f"of a YAML plan file; got {type(plan).__name__}")
    where = (lambda k: f" ({plan.where(k)})") if isinstance(plan, PlanFile) else (lambda k: "")  # noqa: E731
    for key, value in plan.items():
        if key not in paths:
            close = difflib.get_close_matches(str(key), sorted(paths), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else "; see model.named_modules() for the names"
            raise TPCompileError(f"plan names module {key!r}{where(key)}, which the model does not have{hint}")
        if not isinstance(value, str) or value not in PLAN_VALUES:
            raise TPCompileError(f"plan[{key!r}] = {value!r}{where(key)}; use one of {', '.join(PLAN_VALUES)}")
    return dict(plan)


def _group_key(group: Any, world_size: int) -> str:
    """The collectives' key for a group: a registered name, or a ProcessGroup registered now."""
    if isinstance(group, str):
        return group
    size = group.size() if hasattr(group, "size") else None
    if size is not None and size != world_size:
        raise TPCompileError(f"group has {size} ranks but world_size is {world_size}; pass a group of "
                             f"{world_size} ranks or world_size={size}")
    key = f"group{id(group)}"
    register_group(key, group)
    return key


def shard(model: nn.Module, world_size: int, *, example_inputs: Any = (), example_kwargs: Optional[dict] = None,
          dynamic_shapes: Any = None, plan: Any = None, group: Any = "default",
          sequence_parallel: bool = False) -> ShardedModel:
    """Split `model` over `world_size` ranks; returns one GraphModule per rank and the plan.

    `plan` is a dict of module path -> 'replicate' | 'sharded_output' | 'auto', or the path of a
    YAML file holding one (tpcompile.plan_file).

    `group` is the torch.distributed ProcessGroup the ranks' collectives use (default: the
    default group), or the key of one given to `tpcompile.collectives.register_group`.
    """
    _check_world_size(world_size)
    start = time.perf_counter()
    cap = capture(model, example_inputs, example_kwargs, dynamic_shapes)  # capture: torch.export
    captured = time.perf_counter()
    sm = shard_captured(cap, world_size, plan=plan, group=group, sequence_parallel=sequence_parallel)
    sm.timings.update(capture_s=captured - start, passes_s=time.perf_counter() - captured)
    return sm


def shard_captured(cap: Captured, world_size: int, *, plan: Any = None, group: Any = "default",
                   sequence_parallel: bool = False) -> ShardedModel:
    """The passes after capture, on a captured graph that no other ShardedModel uses."""
    _check_world_size(world_size)
    group = _group_key(group, world_size)
    ctx = PassContext(world_size, group=group, plan=_check_plan(plan, cap.module_paths),
                      sequence_parallel=bool(sequence_parallel))
    gm = annotate_pass(cap.gm, ctx)  # annotate: rule per op, fused-projection segments
    gm = propagate_pass(gm, ctx)  # propagate: placements, column/row/vocab roles
    gm = verify_pass(gm, ctx)  # verify: parameter slices tile each parameter
    return ShardedModel(gm, ctx, cap.model_name)


def _check_world_size(world_size: Any) -> None:
    """world_size is a positive int (not a bool, float or string)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise TPCompileError(f"world_size must be an int >= 1, got {world_size!r} ({type(world_size).__name__}); "
                             f"pass the number of ranks, e.g. world_size=2")
