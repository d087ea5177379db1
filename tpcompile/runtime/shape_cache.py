"""Any input shape after one shard() call: a capture per shape the rank graphs' guards refuse, in a bounded LRU.

torch.export keeps every input dim dynamic unless the model's code needs an exact size (an ALiBi or
relative-position bias built in Python from the length, a loop over the batch in a mask path, a scan
over the tokens); the rank graphs then take only the captured size, and their guards
(ops/guards.py) raise `InputShapeError` before anything is computed. Where users call rank graphs
(`tpcompile.simulate`, the rank module `tpcompile.parallelize` returns) a refused shape is captured
and sharded again, from the original model, with the options `shard()` was given:

- The original model is kept by reference (`ShapeCache.model`); its current weights are not read
  for computing: every later capture's rank graphs hold the first capture's parameters and buffers
  (the same tensor objects, by name), so weights loaded, trained or cast once serve every shape. A
  plan that splits a parameter otherwise at the new shape raises (the weights could not be shared).
- The captures are kept in a least-recently-used list of at most `max_shapes` beside the first
  (default 8: a server's handful of length buckets without a capture per request; at
  `TPCOMPILE_MAX_SHAPES` or `ShapeCache.max_shapes`, 0 turns re-sharding off). A call runs on the
  first capture when its guards take the inputs, else on the most recently used capture whose
  guards do, so one capture serves every size its dynamic dims allow.
- The first re-shard of a ShardedModel warns (a TPCompileWarning naming the model, the new shape
  and the guard it broke); later ones are logged. The captures' own shard-time warnings repeat
  the first capture's and are logged.
- Each entry point decides what a new capture's rank graph needs before it runs (`prepare`): the
  simulator shares the weights; parallelize also casts, checkpoints, moves it, and runs the
  startup agreement on the new graph on every rank of the group first (runtime/parallelize.py).
"""
from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn
from torch.fx import GraphModule

from tpcompile.errors import TPCompileError, TPCompileWarning
from tpcompile.ops.guards import InputShapeError
from tpcompile.runtime.reshard import (describe_key, device_of, finding, guard_module, model_tensor_names, on_device,
                                       shape_key, share_tensors, split_difference, user_stacklevel,
                                       whole_parameters)

__all__ = ["DEFAULT_MAX_SHAPES", "ShapeCache", "ShapeEntry", "check_max_shapes", "install_reshard", "rank_graphs_for",
           "share_tensors"]

log = logging.getLogger("tpcompile")
DEFAULT_MAX_SHAPES = 8


def default_max_shapes() -> int:
    """TPCOMPILE_MAX_SHAPES when set, else DEFAULT_MAX_SHAPES."""
    raw = os.environ.get("TPCOMPILE_MAX_SHAPES")
    return DEFAULT_MAX_SHAPES if raw is None else check_max_shapes(raw, "TPCOMPILE_MAX_SHAPES")


def check_max_shapes(value: Any, where: str = "max_shapes") -> int:
    """`value` as a count of kept captures (an int >= 0, or its digits from the environment), or a TPCompileError."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TPCompileError(f"{where}={value!r} is not a count of captures to keep: pass an int >= 0 (8 by "
                             f"default; 0 turns re-sharding for new input shapes off)")
    return value


@dataclass
class ShapeEntry:
    """One capture for other input shapes: the inputs it was made for, its ShardedModel, its guards alone."""

    key: tuple  # ((input name, shape), ...) of the call that made it
    sharded: Any  # ShardedModel
    guards: Optional[GraphModule]
    seconds: float  # its capture and passes
    prepared: set = field(default_factory=set)  # ranks whose graph shares the first capture's weights


class ShapeCache:
    """The captures of one ShardedModel's model per input shape (module docstring); `sm.shapes`."""

    def __init__(self, first: Any, model: nn.Module, shard_again: Callable[[tuple, dict], Any], *,
                 max_shapes: Optional[int] = None) -> None:
        """`first`: the ShardedModel shard() made of `model`; `shard_again(args, kwargs, whole)`: the same capture
        and passes with those example inputs (api.shard's own, so that the captures differ only in their shapes),
        keeping the parameters named in `whole` whole as the first capture kept them."""
        self.first, self.model, self.shard_again = first, model, shard_again
        self.max_shapes = default_max_shapes() if max_shapes is None else check_max_shapes(max_shapes)
        self.modes = [(m, m.training) for m in model.modules()]  # train/eval as at shard() time
        self.grad = torch.is_grad_enabled()
        self.names = model_tensor_names(model)  # what every capture's rank graphs share
        self.reshards = 0
        self._entries: OrderedDict[tuple, ShapeEntry] = OrderedDict()
        self._first_guards: Any = False  # guard_module(first.captured), made at the first check
        self._warned = False
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[tuple]:
        """The kept captures' shape keys, least recently used first."""
        return list(self._entries)

    def refused(self, entry: Optional[ShapeEntry], args: tuple, kwargs: dict) -> Optional[InputShapeError]:
        """The InputShapeError the guards of `entry` (None: the first capture) raise for these inputs, else None."""
        if entry is None and self._first_guards is False:
            self._first_guards = guard_module(self.first.captured)
        guards = self._first_guards if entry is None else entry.guards
        try:
            if guards is not None:
                guards(*args, **kwargs)
        except InputShapeError as e:
            return e
        except Exception:  # noqa: BLE001  another finding (autocast, the inputs' structure): the rank graphs raise it
            return None
        return None

    def entry_for(self, args: tuple, kwargs: dict, *, cause: Optional[InputShapeError] = None) -> Optional[ShapeEntry]:
        """None when the first capture takes these inputs (or re-sharding is off); else the capture that does.

        `cause`: the first capture's refusal when the caller already has it.
        """
        with self._lock:
            cause = cause or self.refused(None, args, kwargs)
            if cause is None or self.max_shapes == 0:
                return None
            for key in reversed(list(self._entries)):
                entry = self._entries[key]
                if self.refused(entry, args, kwargs) is None:
                    self._entries.move_to_end(key)
                    return entry
            entry = self._reshard(args, kwargs, cause)
            self._entries[entry.key] = entry
            while len(self._entries) > self.max_shapes:
                old, _ = self._entries.popitem(last=False)
                log.info("%s: dropped the capture for %s (at most %d kept)", self.first.model_name,
                         describe_key(old), self.max_shapes)
            return entry

    def sharded_for(self, *args: Any, **kwargs: Any) -> Any:
        """The ShardedModel whose rank graphs take these inputs, each sharing the first capture's weights."""
        entry = self.entry_for(args, kwargs)
        if entry is None:
            return self.first
        for r in range(self.first.world_size):
            self.rank(entry, r)
        return entry.sharded

    def rank(self, entry: ShapeEntry, r: int,
             prepare: Optional[Callable[[Any, int], Any]] = None) -> GraphModule:
        """Rank r's graph of `entry`, made ready once: `prepare(sharded, r)`, by default sharing rank r's weights."""
        with self._lock:
            if r not in entry.prepared:
                if prepare is None:
                    share_tensors(entry.sharded.rank(r), self.first.rank(r), self.names)
                else:
                    prepare(entry.sharded, r)
                entry.prepared.add(r)
            return entry.sharded.rank(r)

    def _reshard(self, args: tuple, kwargs: dict, cause: InputShapeError) -> ShapeEntry:
        """Capture and shard the model again at these inputs, as shard() did at the first."""
        name, key = self.first.model_name, shape_key(self.model, args, kwargs)
        start = time.perf_counter()
        ex_args, ex_kwargs = on_device(args, device_of(self.model)), on_device(kwargs, device_of(self.model))
        with warnings.catch_warnings(record=True) as seen, self._as_at_shard():
            warnings.simplefilter("always", TPCompileWarning)
            try:
                sm = self.shard_again(ex_args, ex_kwargs, whole_parameters(self.first.plan))
            except TPCompileError as e:
                raise TPCompileError(f"{name}: capturing the model again for {describe_key(key)} (which its captured "
                                     f"graph does not take: {finding(cause)}) failed: {e}") from e
        for w in seen:
            log.info("%s at %s: %s", name, describe_key(key), w.message)
        differ = split_difference(self.first.plan, sm.plan)
        if differ is not None:
            raise TPCompileError(f"{name}: the capture for another input shape ({describe_key(key)}) splits {differ}, "
                                 f"so its rank graphs cannot share the first capture's weights; shard with example "
                                 f"inputs of the shape you run with, or pin the split with plan=")
        seconds = time.perf_counter() - start
        self.reshards += 1
        self._say(name, key, cause, seconds)
        return ShapeEntry(key, sm, guard_module(sm.captured), seconds)

    def _say(self, name: str, key: tuple, cause: InputShapeError, seconds: float) -> None:
        """One TPCompileWarning per ShardedModel at its first re-shard; a log line for each later one."""
        if self._warned:
            log.info("%s: re-sharded for %s in %.2f s (%d captures kept)", name, describe_key(key), seconds,
                     len(self._entries) + 1)
            return
        self._warned = True
        warnings.warn(
            f"{name}: called with {describe_key(key)}, which its captured graph does not take ({finding(cause)}); "
            f"re-captured and re-sharded {name} for that shape from the original model in {seconds:.2f} s, its "
            f"rank graphs sharing the first capture's weights. Each new shape the guards refuse costs one capture; "
            f"up to {self.max_shapes} are kept, least recently used dropped first (sm.shapes.max_shapes, "
            f"parallelize(max_shapes=), TPCOMPILE_MAX_SHAPES). Later re-shards of this model are logged, not warned",
            TPCompileWarning, stacklevel=user_stacklevel())

    @contextmanager
    def _as_at_shard(self) -> Iterator[None]:
        """The model's train/eval flags and the grad mode as they were at shard() time; restored after."""
        now = [(m, m.training) for m in self.model.modules()]
        try:
            for m, mode in self.modes:
                m.training = mode
            with torch.set_grad_enabled(self.grad):
                yield
        finally:
            for m, mode in now:
                m.training = mode


def rank_graphs_for(sharded: Any, args: tuple, kwargs: dict) -> list[GraphModule]:
    """Every rank's graph for these inputs: the ShardedModel's own, or a capture's for their shape (re-sharded)."""
    cache: Optional[ShapeCache] = getattr(sharded, "shapes", None)
    entry = cache.entry_for(args, kwargs) if cache is not None else None
    if entry is None:
        return [sharded.rank(r) for r in range(sharded.world_size)]
    return [cache.rank(entry, r) for r in range(sharded.world_size)]


class _Resharding:
    """A rank module's forward that runs a call its guards refuse on a capture for that call's shape.

    `graph_forward`: what runs gm's own graph (None: its generated code, gm.code); tpcompile.profile puts its
    instrumented copy there for the `with` block (runtime/profiler_marks.py), so the dispatch stays in place.
    """

    def __init__(self, gm: GraphModule, cache: ShapeCache, rank: int, prepare: Callable[[Any, int], Any]) -> None:
        self.gm, self.cache, self.rank, self.prepare = gm, cache, rank, prepare
        self.graph_forward: Optional[Callable[..., Any]] = None

    def graphs(self) -> list[GraphModule]:
        """The rank graphs of this rank's captures for other shapes made so far (not gm itself)."""
        with self.cache._lock:
            return [e.sharded.rank(self.rank) for e in self.cache._entries.values() if self.rank in e.prepared]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:  # its own graph: the guards run first
            if self.graph_forward is not None:
                return self.graph_forward(*args, **kwargs)
            return type(self.gm).forward(self.gm, *args, **kwargs)
        except InputShapeError as e:
            entry = self.cache.entry_for(args, kwargs, cause=e)
            if entry is None:  # re-sharding is off
                raise
        return self.cache.rank(entry, self.rank, self.prepare)(*args, **kwargs)


def install_reshard(gm: GraphModule, cache: Optional[ShapeCache], rank: int,
                    prepare: Callable[[Any, int], Any]) -> None:
    """Calls of gm (rank `rank`'s module) at shapes its guards refuse run on a capture for their shape.

    `prepare(sharded, rank)` makes such a capture's rank graph ready before its first call (weights shared with
    gm's, the entry point's own steps); the first capture's graph stays gm's own (gm.graph, gm.code).
    """
    if cache is not None:
        gm.forward = _Resharding(gm, cache, rank, prepare)  # an instance attribute: nn.Module calls it
