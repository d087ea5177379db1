"""`tpcompile.profile(module)`: where a rank's step goes, block by block and collective by collective.

    with tpcompile.profile(local) as prof:          # a parallelize() module or a HybridModel
        for batch in batches:
            loss = loss_fn(local(batch), batch)
            loss.backward()
            with prof.region("optimizer"):
                opt.step(); opt.zero_grad()
            prof.step()                             # one call per step: ends it, starts the next
    print(prof.report().table())                   # on every rank (it gathers the ranks' records)
    prof.save_trace("trace.json")                   # every rank calls it; rank 0 writes one merged file

Inside the block, every GraphModule the module runs gets a forward with record_function regions
around its blocks and collectives (runtime/profiler_marks.py) and torch.profiler records the
events; each step starts right after a barrier of the group, so the ranks' clocks read from the
same moment and a collective's waiting on a late peer can be told from its own cost.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from tpcompile.errors import TPCompileError
from tpcompile.runtime.profiler_events import Event, StepRecord, compact, read_steps
from tpcompile.runtime.profiler_marks import REGION, STEP, install

__all__ = ["Profile", "RankProfile", "profile"]

_enter = torch.ops.profiler._record_function_enter_new.default
_exit = torch.ops.profiler._record_function_exit._RecordFunction


@dataclass
class RankProfile:
    """One rank's steps, the ranks its tensor-parallel collectives span, and its raw events (for traces)."""

    rank: int
    peers: tuple[int, ...]
    steps: list[StepRecord]
    events: list[Event] = field(default_factory=list)
    layers: list[str] = field(default_factory=list)
    modules: dict[str, list[str]] = field(default_factory=dict)  # block -> the module paths of its nodes


def _group_of(module: Any, group: Any) -> Any:
    """The tensor-parallel group whose collectives the module runs: `group`, a HybridModel's "tp", else WORLD."""
    if group is not None:
        return group
    mesh = getattr(module, "mesh", None)
    if mesh is not None and "tp" in (mesh.mesh_dim_names or ()):
        return mesh["tp"].get_group()
    return None


def _distributed() -> bool:
    """True inside an initialised process group of more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _on_cuda(module: Any) -> bool:
    """True when the module's first parameter is on a CUDA device (its regions then wait for the device)."""
    params = module.parameters() if hasattr(module, "parameters") else iter(())
    first = next(iter(params), None)
    return first is not None and first.device.type == "cuda"


class Profile:
    """A profile of the steps run inside `with tpcompile.profile(module) as prof:`; see the module's docstring."""

    def __init__(self, module: Any, *, group: Any = None, layers: Optional[Sequence[str]] = None,
                 keep_events: bool = True) -> None:
        """Check the module; nothing is instrumented before the `with` block starts."""
        if not hasattr(module, "stages") and not isinstance(module, torch.fx.GraphModule):
            raise TPCompileError(f"tpcompile.profile: {type(module).__name__} is neither a rank module "
                                 f"(tpcompile.parallelize, ShardedModel.rank) nor a HybridModel "
                                 f"(tpcompile.parallelize_train); pass one of those")
        self.module, self.keep_events = module, keep_events
        self.layers = list(layers) if layers is not None else None  # None: read them off the graphs
        self.group = _group_of(module, group)
        self._cuda = _on_cuda(module)
        self._prof: Any = None
        self._open: Any = None
        self._count = 0
        self._installed: Any = None
        self.result: Optional[RankProfile] = None
        self.skipped = 0  # GraphModules left uninstrumented (their own forward wrapper: activation checkpointing)

    def __enter__(self) -> "Profile":
        """Instrument the module, start torch.profiler and the first step."""
        self._installed = install(self.module, self.layers)
        self.layers, self.skipped = self._installed.layers, self._installed.skipped
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self._cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=activities)
        try:
            self._prof.__enter__()
        except BaseException:
            self._installed.undo()
            raise
        self._begin()
        return self

    def _sync(self) -> None:
        """Wait for the device, so that a region ends when its work does (CUDA runs asynchronously)."""
        if self._cuda:
            torch.cuda.synchronize()

    def _begin(self) -> None:
        """Line the ranks up (a barrier), then open the next step's region."""
        self._sync()
        if _distributed():
            dist.barrier(group=self.group)
        self._open = _enter(f"{STEP}{self._count}", None)
        self._count += 1

    def _end(self) -> None:
        """Close the open step's region."""
        self._sync()
        if self._open is not None:
            _exit(self._open)
            self._open = None

    def step(self) -> None:
        """End this step and start the next (call it once at the end of every step of the loop)."""
        if self._prof is None:
            raise TPCompileError("Profile.step() belongs inside `with tpcompile.profile(module) as prof:`; call it "
                                 "there, once at the end of each step")
        self._end()
        self._begin()

    @contextmanager
    def region(self, name: str) -> Iterator[None]:
        """Time a part of the loop under `name` (the loss, the optimizer step, data loading)."""
        with torch.profiler.record_function(REGION + str(name).replace(" ", "_")):
            yield
            self._sync()

    def __exit__(self, *exc: Any) -> None:
        """End the last step, stop the profiler, restore the module and read this rank's steps."""
        try:
            self._end()
        finally:
            self._prof.__exit__(*exc)
            self._installed.undo()
        if exc and exc[0] is not None:
            return
        events = compact(self._prof.events())
        peers = tuple(dist.get_process_group_ranks(self.group) if self.group is not None else
                      range(dist.get_world_size())) if _distributed() else (0,)
        steps = [s for s in read_steps(events, len(peers)) if not s.empty]
        rank = dist.get_rank() if _distributed() else 0
        self.result = RankProfile(rank, peers, steps, events if self.keep_events else [], list(self.layers or ()),
                                  self._installed.modules)
        self._prof = None

    def gather(self, *, events: bool = False) -> list[RankProfile]:
        """Every rank's RankProfile (a collective over all processes when distributed: call it on every rank)."""
        if self.result is None:
            raise TPCompileError("tpcompile.profile: no profile yet; report() and save_trace() come after the "
                                 "`with tpcompile.profile(module) as prof:` block")
        mine = self.result if events else dataclasses.replace(self.result, events=[])
        if not _distributed():
            return [mine]
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        return every

    def report(self, prediction: Any = None, **facts: Any) -> Any:
        """The ProfileReport of every rank's steps (call it on every rank), with a prediction beside it if given."""
        from tpcompile.report.profile_report import build_report
        return build_report(self.gather(), prediction=prediction, **facts)

    def save_trace(self, path: str | Path) -> Optional[Path]:
        """Write a Chrome trace: one merged file of every rank from rank 0, or one per rank where path has
        '{rank}'; the path written, or None on the ranks that write nothing."""
        from tpcompile.report.profile_trace import chrome_trace
        text = str(path)
        if "{rank}" in text:
            if self.result is None:
                self.gather()  # raises: nothing profiled yet
            out = Path(text.format(rank=self.result.rank))  # type: ignore[union-attr]
            out.write_text(json.dumps(chrome_trace([self.result])))  # type: ignore[list-item]
            return out
        ranks = self.gather(events=True)
        if self.result is not None and self.result.rank != 0:
            return None
        out = Path(text)
        out.write_text(json.dumps(chrome_trace(ranks)))
        return out


def profile(module: Any, *, group: Any = None, layers: Optional[Sequence[str]] = None) -> Profile:
    """A context manager that profiles the steps of `module` (a rank module or a HybridModel) run inside it."""
    return Profile(module, group=group, layers=layers)
