"""Startup check: every rank's graph issues the same collectives, in the same order, on the same shapes."""
from __future__ import annotations

import hashlib
import logging
import re
from typing import Any, Optional

import torch
import torch._refs
import torch.distributed as dist
import torch.fx.experimental._config as fx_config
from torch.fx import GraphModule, Interpreter

from tpcompile.errors import TPCompileError
from tpcompile.ops.schedule import CollectiveCall, collective_name, graph_schedule
from tpcompile.runtime.backends import world_size_of

__all__ = ["check_schedules", "digest", "first_difference", "schedule"]

log = logging.getLogger("tpcompile")

Entry = CollectiveCall  # (op, shape, dtype, other arguments)


# ops whose fake kernel specializes symbolic sizes (it reads them as ints), run as their symbolic decomposition
_SYMBOLIC = {torch.ops.aten.constant_pad_nd.default: torch._refs.constant_pad_nd}


class _Recorder(Interpreter):
    """Runs a rank graph on fake tensors, noting each collective's input."""

    def __init__(self, gm: GraphModule, group_name: str) -> None:
        super().__init__(gm)
        self.group_name = group_name
        self.entries: list[Entry] = []

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        # export's input guards need concrete sizes; the captured graph already checked them
        return None if target == "_guards_fn" else super().call_module(target, args, kwargs)

    def _named(self, args: tuple) -> tuple:
        """The other arguments, the group's key (it holds an object id, different per process) named alike."""
        return tuple(self.group_name if isinstance(a, str) else a for a in args)

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        op = collective_name(target)
        if op is not None:
            x = args[0]
            if isinstance(x, (list, tuple)):  # a bucket of tensors (grad_bucket_all_reduce): each one's shape
                shape = tuple(f"({', '.join(str(d) for d in t.shape)})" for t in x)
                dtype = ",".join(sorted({str(t.dtype) for t in x}))
            else:
                shape, dtype = tuple(str(d) for d in x.shape), str(x.dtype)
            if kwargs.get("size") is not None:  # a gather of shares that differ by one: the even share on every rank
                d = args[1] % x.dim()
                shape = shape[:d] + (str(kwargs["size"] // world_size_of(args[2])),) + shape[d + 1:]
            self.entries.append(CollectiveCall(op, shape, dtype, self._named(args[1:])))
        if target in _SYMBOLIC:  # its kernel reads concrete sizes, which would fix the symbolic ones (a padded block)
            return _SYMBOLIC[target](*args, **kwargs)
        return super().call_function(target, args, kwargs)


def schedule(gm: GraphModule, fake_inputs: list, *, group_name: str = "group") -> list[Entry]:
    """The (op, shape with symbolic dims, dtype, arguments) of each collective a rank runs in forward.

    `fake_inputs` are the captured graph's placeholder values (fake tensors with symbolic
    sizes), so the schedule holds for every batch size and sequence length at once.
    """
    mode = next((v.fake_mode for v in fake_inputs if hasattr(v, "fake_mode")), None)
    if mode is None:
        raise TPCompileError("schedule needs the captured graph's fake inputs (placeholder meta['val'])")
    rec = _Recorder(gm, group_name)
    saved = mode.allow_non_fake_inputs
    mode.allow_non_fake_inputs = True  # the rank's own (real or meta) parameters
    symbols = {s for v in fake_inputs if isinstance(v, torch.Tensor) for d in v.shape
               if isinstance(d, torch.SymInt) for s in d.node.expr.free_symbols}
    fixed = _fixed_sizes(mode, symbols)
    try:
        # sizes taken as >= 2 (size-oblivious): a rank's share of a few example tokens (0 or 1) stays symbolic
        with mode, torch.no_grad(), fx_config.patch(backed_size_oblivious=True):
            rec.run(*fake_inputs)
    except Exception as e:  # noqa: BLE001  a graph fake tensors cannot run still gets a check
        log.warning("collective schedule without shapes: fake-tensor tracing failed (%s: %s)",
                    type(e).__name__, e)
        return _structural(gm, group_name)
    finally:
        mode.allow_non_fake_inputs = saved
    if _fixed_sizes(mode, symbols) - fixed:  # a size of 0 or 1 at the example (a rank's share of few tokens)
        log.info("collective schedule without shapes: tracing fixed a symbolic size of the inputs at the example's")
        return _structural(gm, group_name)
    return _rename_symbols(rec.entries)


def _fixed_sizes(mode: Any, symbols: set) -> set:
    """The size symbols that the shape environment has fixed to a number."""
    env = getattr(mode, "shape_env", None)
    if env is None:
        return set()
    return {s for s in symbols if s in env.replacements and env.replacements[s].is_number}


def _structural(gm: GraphModule, group_name: str) -> list[Entry]:
    """The collectives in graph order (the order they run), shapes and dtypes unknown."""
    return [CollectiveCall(call.op, ("?",), "?", tuple(group_name if isinstance(a, str) else a for a in call.args))
            for call, _ in graph_schedule(gm)]


def _rename_symbols(entries: list[Entry]) -> list[Entry]:
    """Symbols renamed d0, d1, ... by first use, so that equal schedules compare equal."""
    names: dict[str, str] = {}

    def sub(m: re.Match) -> str:
        return names.setdefault(m.group(0), f"d{len(names)}")
    return [e._replace(shape=tuple(re.sub(r"\b[su]\d+\b", sub, d) for d in e.shape)) for e in entries]


def digest(entries: list[Entry]) -> str:
    """A short hash of a schedule, for logs."""
    return hashlib.sha256(repr(entries).encode()).hexdigest()[:16]


def _describe(e: Optional[Entry]) -> str:
    return "nothing (its schedule ends here)" if e is None else str(e)


def _same(a: Entry, b: Entry) -> bool:
    """The same collective: op and arguments, and shape and dtype unless a rank could not trace them ('?')."""
    shapes = a.shape == b.shape or ("?",) in (a.shape, b.shape)
    dtypes = a.dtype == b.dtype or "?" in (a.dtype, b.dtype)
    return a.op == b.op and a.args == b.args and shapes and dtypes


def first_difference(schedules: list[list[Entry]]) -> Optional[str]:
    """None when every rank's schedule matches rank 0's (shapes a rank could not trace match any), else a message
    naming the first difference."""
    ref = schedules[0]
    for r, other in enumerate(schedules[1:], start=1):
        if len(other) == len(ref) and all(_same(a, b) for a, b in zip(ref, other)):
            continue
        i = next((k for k, (a, b) in enumerate(zip(ref, other)) if not _same(a, b)), min(len(ref), len(other)))
        at = lambda s: s[i] if i < len(s) else None  # noqa: E731
        return (f"collective schedules differ between ranks at collective #{i}: rank 0 issues "
                f"{_describe(at(ref))}, rank {r} issues {_describe(at(other))} (rank 0 has "
                f"{len(ref)} collectives, rank {r} {len(other)}). Every rank must shard the same "
                f"model with the same config, plan, world size and example inputs' ranks")
    return None


def check_schedules(entries: list[Entry], group: Any = None) -> str:
    """Exchange schedules over the process group; raise TPCompileError on the first mismatch.

    Runs on every rank; the exchange is bounded by the group's timeout. Returns the digest.
    """
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, entries, group=group)
    why = first_difference(gathered)
    if why is not None:
        raise TPCompileError(why)
    return digest(entries)
