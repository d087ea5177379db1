"""shard() and ShardedModel: the public entry point, and the pipeline as one straight list.

    capture      capture.capture                      torch.export, every input dim dynamic
    annotate     passes/annotate.annotate_pass        node.meta['tp_rule']: the op table row
    propagate    passes/propagate.propagate_pass      node.meta['tp_placement'], ['tp_layout']
    pieces       passes/piece_reads.warn_pieces_read_whole  a warning per weight a matmul reads in pieces
    freeze       passes/decisions.freeze              the frozen plan (Decisions): node -> layout, parameter -> cut
    verify       passes/verify_plan.verify_pass       the slices tile every split parameter
    plan         passes/plan.build_plan               ShardedModel.plan
    rewrite(r)   passes/rewrite.rewrite_pass          rank r's GraphModule (on first use)
    comm(r)      passes/comm_*.py                     by default in-place all-reduces, gradient buckets; opt-in async
    verify(r)    passes/verify_ranks.verify_rank      lint, planned shapes, rank 0's collectives
    lower(r)     passes/comm_lower.lower_pass         with comm=CommOptions(lower_c10d=True): _c10d_functional ops

`shard()` is capture then `shard_captured()`; `ShardedModel.rank(r)` runs the last four, reading the frozen
plan (`ShardedModel.decisions`) and nothing else the passes before it wrote.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Iterator, Optional

from torch import nn
from torch.fx import GraphModule

from tpcompile.capture import Captured, capture
from tpcompile.capture.input_dims import guard_dims_fixed_later
from tpcompile.errors import TPCompileError
from tpcompile.ops.schedule import FORWARD_COLLECTIVES, collective_op, graph_schedule
from tpcompile.overrides import check_overrides
from tpcompile.passes.annotate import annotate_pass
from tpcompile.passes.comm_async import async_pass
from tpcompile.passes.comm_bucket import bucket_pass
from tpcompile.passes.comm_inplace import inplace_pass
from tpcompile.passes.comm_linear_grads import linear_grads_pass
from tpcompile.passes.comm_lower import lower_pass
from tpcompile.passes.comm_options import CommOptions, comm_options
from tpcompile.passes.decisions import Decisions, freeze
from tpcompile.passes.pass_context import PassContext, module_path
from tpcompile.passes.plan import Plan, build_plan
from tpcompile.passes.piece_reads import warn_pieces_read_whole
from tpcompile.passes.propagate import propagate_pass
from tpcompile.passes.rewrite import rewrite_graph, rewrite_pass
from tpcompile.passes.verify_plan import verify_pass
from tpcompile.passes.verify_ranks import verify_rank
from tpcompile.placement import ParamSlice
from tpcompile.runtime.backends import register_group
from tpcompile.runtime.shape_cache import ShapeCache

log = logging.getLogger("tpcompile")


def shard(model: nn.Module, world_size: int, *, example_inputs: Any = (), example_kwargs: Optional[dict] = None,
          dynamic_shapes: Any = None, plan: Any = None, group: Any = "default",
          sequence_parallel: bool = False, comm: Any = None) -> ShardedModel:
    """Split `model` over `world_size` ranks; returns one GraphModule per rank and the plan.

    `plan` is a dict of module path -> 'replicate' | 'sharded_output' | 'auto', or the path of a
    YAML file holding one (tpcompile.overrides).

    `group` is the torch.distributed ProcessGroup the ranks' collectives use (default: the
    default group), or the key of one given to `tpcompile.ops.collectives.register_group`.

    `comm` picks the communication passes run on every rank graph (docs/communication.md): the
    default None runs the proven ones (in-place all-reduces, gradient buckets: `CommOptions()`, as
    True does), False none (the collectives as rewrite emits them), a `CommOptions` exactly its own.
    """
    _check_world_size(world_size)
    start = time.perf_counter()
    cap = capture(model, example_inputs, example_kwargs, dynamic_shapes)  # capture: torch.export
    captured = time.perf_counter()
    sm = shard_captured(cap, world_size, plan=plan, group=group, sequence_parallel=sequence_parallel, comm=comm)
    sm.timings.update(capture_s=captured - start, passes_s=time.perf_counter() - captured)
    # shapes the guards refuse: all this again, keeping whole what this capture keeps whole (runtime/shape_cache.py)
    sm.shapes = ShapeCache(sm, model, lambda args, kwargs, whole: shard_captured(
        capture(model, args, kwargs, dynamic_shapes), world_size, plan=plan, group=group,
        sequence_parallel=sequence_parallel, comm=comm, whole=whole))
    return sm


def shard_captured(cap: Captured, world_size: int, *, plan: Any = None, group: Any = "default",
                   sequence_parallel: bool = False, comm: Any = None, whole: frozenset = frozenset()) -> ShardedModel:
    """The passes after capture, on a captured graph that no other ShardedModel uses; `whole`: parameter names
    kept whole from the start (what a first capture kept whole, when the model is captured again for a shape)."""
    _check_world_size(world_size)
    ctx = PassContext(world_size, group=_group_key(group, world_size), whole=frozenset(whole),
                      overrides=check_overrides(plan, cap.module_paths), sequence_parallel=bool(sequence_parallel))
    gm = annotate_pass(cap.gm, ctx)  # annotate: rule per op, fused-projection segments
    gm = propagate_pass(gm, ctx)  # propagate: placements, column/row/vocab roles
    warn_pieces_read_whole(gm, ctx)  # weights a matmul reads in pieces stay whole: say so
    decisions = freeze(gm, ctx)  # freeze: the decision as one value, taken off the graph
    gm = verify_pass(gm, decisions)  # verify: parameter slices tile each parameter
    sm = ShardedModel(gm, decisions, cap.model_name, build_plan(gm, decisions, ctx))  # plan: what was decided
    sm.comm, sm.examples = comm_options(comm), (cap.example_args, cap.example_kwargs)
    guard_dims_fixed_later(gm, *sm.examples, cap.model_name)  # none, unless a pass compared a symbolic size
    return sm


class ShardedModel:
    """One torch.fx GraphModule per rank, built on first use, plus the plan behind them."""

    def __init__(self, captured: GraphModule, decisions: Decisions, model_name: str, plan: Plan) -> None:
        self.captured = captured
        self.decisions = decisions  # the frozen plan: node -> rule, placement, layout; parameter -> cut
        self.world_size = decisions.world_size
        self.model_name = model_name
        self.plan = plan
        self.timings: dict[str, float] = {}  # seconds: capture_s (torch.export), passes_s
        self._ranks: dict[int, GraphModule] = {}
        self._reference: Optional[list] = None
        self._lock = threading.Lock()
        self.comm: Optional[CommOptions] = None  # the communication passes run on each rank graph
        self.shapes: Optional[ShapeCache] = None  # shard()'s: a capture per input shape the guards refuse
        self.examples: tuple = ((), {})  # the example (args, kwargs) the capture ran

    def rank(self, r: int) -> GraphModule:
        """Rank r's GraphModule: the model's arguments in, the model's output structure out."""
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < self.world_size:
            kind = "" if isinstance(r, int) and not isinstance(r, bool) else f" ({type(r).__name__}, not an int)"
            raise TPCompileError(f"rank {r!r}{kind} is out of range for world size {self.world_size}; "
                                 f"ranks are the ints 0 to {self.world_size - 1}")
        with self._lock:  # ranks may be asked for from several threads at once
            if r not in self._ranks:
                log.info("building rank %d of %d", r, self.world_size)
                gm = self._comm(rewrite_pass(self.captured, self.decisions, r))  # rewrite(r), comm(r)
                if self._reference is None:  # rank 0's schedule, even in a process that builds only rank r
                    ref = gm if r == 0 else self._comm(rewrite_graph(self.captured, self.decisions, 0))
                    self._reference = graph_schedule(ref)
                shapes = {name: pp.local_shape for name, pp in self.plan.parameters.items()}
                verify_rank(gm, self._reference, r, shapes)  # verify(r): lint, planned slices, rank 0's collectives
                if self.comm is not None and self.comm.lower_c10d:
                    gm = lower_pass(gm)  # lower(r): _c10d_functional collectives, for torch.compile
                self._ranks[r] = gm
                guard_dims_fixed_later(self.captured, *self.examples, self.model_name)  # as after the plan
            return self._ranks[r]

    def _comm(self, g: Any) -> Any:
        """The communication passes on a rank graph (or GraphModule), in order, when comm= asked for them."""
        if self.comm is None:
            return g
        if self.comm.inplace:
            g = inplace_pass(g)  # in-place: an all-reduce of a dead temporary sums into it
        if self.comm.asynchronous:
            g = linear_grads_pass(g)  # overlap: input-gradient all-reduce of column splits during weight gradients
        if self.comm.inplace and self.comm.asynchronous:
            g = async_pass(g)  # async: those all-reduces start after their input, wait before their first reader
        if self.comm.bucket_bytes:
            g = bucket_pass(g, self.decisions, self.comm.bucket_bytes)  # buckets: per-parameter gradient syncs, fused
        return g

    def __getitem__(self, r: int) -> GraphModule:
        return self.rank(r)

    def __len__(self) -> int:
        return self.world_size

    def __iter__(self) -> Iterator[GraphModule]:
        return (self.rank(r) for r in range(self.world_size))

    def collectives(self, *, forward_only: bool = True) -> list[tuple[str, str]]:
        """(op, module path) of each collective node in a rank's graph, in order."""
        ops = ((collective_op(n), n) for n in self.rank(0).graph.nodes)
        return [(op, module_path(n)) for op, n in ops
                if op is not None and (op in FORWARD_COLLECTIVES or not forward_only)]

    # The public surface the neighbouring packages (checkpoint/, hybrid/, generate/, strategy/, runtime/) read.
    @property
    def group(self) -> str:
        """The collectives' group key the rank graphs were built for."""
        return self.decisions.group

    @property
    def overrides(self) -> dict[str, str]:
        """The user's per-module overrides (module path -> replicate | sharded_output | auto), as applied."""
        return dict(self.decisions.overrides)

    def state_names(self) -> list[str]:
        """The names of every parameter and buffer the captured graph reads, tied aliases each listed."""
        return list(self.decisions.tensors)

    def full_shape(self, name: str) -> tuple[int, ...]:
        """The unsharded shape of the parameter or buffer `name`."""
        return tuple(self.decisions.tensors[name].shape)

    def slice_for(self, name: str) -> Optional[ParamSlice]:
        """How the parameter or buffer `name` is cut across the ranks (None: whole on every rank)."""
        return self.decisions.slice_for(name)

    def aliases(self, name: str) -> list[str]:
        """Every name of the tensor called `name` (tied parameters have several), itself included."""
        return self.decisions.aliases(name)

    def rank_graph(self, r: int) -> Any:
        """Rank r's graph as rewrite and the communication passes leave it, before verification and lowering."""
        return self._comm(rewrite_graph(self.captured, self.decisions, r))

    def merge_state_dicts(self, states: list[dict], *, strict: bool = True) -> dict:
        """The original model's state dict, put together from every rank's `state_dict()`."""
        from tpcompile.checkpoint.merge import merge_state_dicts
        return merge_state_dicts(self, states, strict=strict)

    def summary(self) -> str:
        """The plan as text: every parameter's split and bytes per rank, per block, the forward collectives."""
        from tpcompile.report.plan_table import summary_text
        return summary_text(self)

    def __repr__(self) -> str:
        return f"ShardedModel({self.model_name}, world_size={self.world_size})"


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


def _check_world_size(world_size: Any) -> None:
    """world_size is a positive int (not a bool, float or string)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise TPCompileError(f"world_size must be an int >= 1, got {world_size!r} ({type(world_size).__name__}); "
                             f"pass the number of ranks, e.g. world_size=2")
