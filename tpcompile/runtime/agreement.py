"""The startup agreement: before any collective of the model runs, the ranks show each other what they will run.

Two exchanges (`all_gather_object` over the group), each a few records per tensor or a digest:

1. `agree_state`, before capture: every parameter and buffer by name, shape and dtype, and a
   fingerprint of its values (runtime/fingerprint.py). Another name, shape or dtype on one rank (an
   extra layer, another width, another dtype) raises a TPCompileError on every rank naming the first
   difference. Values that differ while everything else agrees (a model built without the same seed
   on every rank) are replaced by rank 0's, broadcast tensor by tensor, as DistributedDataParallel does
   at construction; rank 0 logs one line saying how many tensors of which ranks were replaced.
2. `agree_program`, after sharding: a digest of the captured graph (every node's op, target,
   arguments and module), of the plan, and the collective schedule. Other model code with the same
   tensors (another head count, another activation) or another plan raises, naming the first node
   (or parameter split) where two ranks differ; the full records are exchanged only then.
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist

from tpcompile.errors import TPCompileError
from tpcompile.runtime.failures import translate
from tpcompile.runtime.fingerprint import (TensorEntry, digest, first_difference_at, graph_digest, tensor_entries,
                                           values_differ)
from tpcompile.runtime.startup_check import first_difference as schedule_difference

__all__ = ["agree_program", "agree_state", "distributed", "process_group"]

log = logging.getLogger("tpcompile")

SAME_MODEL = ("every rank must build the same model (the same code, config and dtype) and call {entry} with the "
              "same arguments")


_NOT_DISTRIBUTED = object()


def process_group(group: Any, world_size: int) -> Any:
    """The torch.distributed group that `group` (a ProcessGroup, a registered key, "default") names in this process.

    `_NOT_DISTRIBUTED` (compare with `is`) when there is none: no process group is running, the calling thread
    is a simulated rank, or the group's size is not `world_size` (the ranks then run elsewhere).
    """
    from tpcompile.runtime.backends import _groups, _simulated
    if not (dist.is_available() and dist.is_initialized()) or _simulated() is not None:
        return _NOT_DISTRIBUTED
    pg = None if group == "default" else (_groups.get(group) if isinstance(group, str) else group)
    if isinstance(pg, int) or (isinstance(group, str) and group != "default" and pg is None):
        return _NOT_DISTRIBUTED
    return pg if dist.get_world_size(pg) == world_size else _NOT_DISTRIBUTED


def distributed(pg: Any) -> bool:
    """True when `pg` (from process_group) is a running group."""
    return pg is not _NOT_DISTRIBUTED


def _gather(obj: Any, group: Any) -> list:
    """Every rank's obj, in group rank order (a dead or stalled peer is a TPCompileError saying so)."""
    out: list = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(out, obj, group=group)
    except RuntimeError as e:
        raise translate(e, where="the startup agreement's exchange of fingerprints", group=group) from e
    return out


def _entry(t: Optional[TensorEntry]) -> str:
    return "nothing (its list ends there)" if t is None else t.describe()


def agree_state(named: Iterable[tuple[str, torch.Tensor]], group: Any, *, values: bool, entry: str) -> int:
    """Raise unless every rank holds tensors of the same names, shapes and dtypes; adopt rank 0's differing values.

    Returns the number of tensors whose values were replaced by rank 0's on this rank.
    """
    named = list(named)
    entries = tensor_entries(named, values=values)
    every = _gather(entries, group)
    r, i = first_difference_at([[e.layout() for e in es] for es in every])
    if r >= 0:
        at = lambda es: es[i] if i < len(es) else None  # noqa: E731
        raise TPCompileError(
            f"{entry}: the ranks hold different models: at tensor #{i} rank 0 has {_entry(at(every[0]))}, rank {r} "
            f"has {_entry(at(every[r]))} (rank 0 holds {len(every[0])} parameters and buffers, rank {r} "
            f"{len(every[r])}); {SAME_MODEL.format(entry=entry)}")
    differ = [k for k in range(len(entries)) if any(values_differ(every[0][k], es[k]) for es in every[1:])]
    if not differ:
        return 0
    _adopt(named, differ, group)
    me = dist.get_rank(group)
    if me == 0:
        ranks = sorted({r for r, es in enumerate(every) for k in differ if values_differ(every[0][k], es[k])})
        log.warning("%s: %d of %d parameters and buffers differ between ranks (first: %s, on rank%s %s); every rank "
                    "now holds rank 0's values, broadcast as DistributedDataParallel does. To start from the same "
                    "weights without it, build the model after torch.manual_seed(s) with the same s on every rank, "
                    "or pass weights=", entry, len(differ), len(entries), entries[differ[0]].name,
                    "s" if len(ranks) > 1 else "", ", ".join(map(str, ranks)))
    return sum(1 for k in differ if values_differ(every[0][k], every[me][k]))


def _adopt(named: list[tuple[str, torch.Tensor]], indices: list[int], group: Any) -> None:
    """Broadcast the given tensors from the group's rank 0 into every rank's own (tied tensors once)."""
    src = 0 if group is None else dist.get_global_rank(group, 0)
    on_gpu = dist.get_backend(group) == "nccl"
    done: set[int] = set()
    with torch.no_grad():
        for k in indices:
            t = named[k][1]
            if id(t) in done:
                continue
            done.add(id(t))
            buf = t.detach()
            direct = buf.is_contiguous() and (buf.is_cuda or not on_gpu)  # received straight into the tensor
            if not direct:
                buf = buf.to("cuda" if on_gpu else buf.device).contiguous()
            dist.broadcast(buf, src=src, group=group)
            if not direct:
                t.copy_(buf)


def agree_program(graph: list[str], plan: list[str], schedule: Optional[list], group: Any, *, entry: str,
                  graph_label: str = "captured graph") -> str:
    """Raise on every rank unless all ranks captured the same graph, made the same plan and issue one schedule.

    Returns the digest of the agreed graph and plan, for logs.
    """
    mine = (graph_digest(graph), digest(plan), schedule)
    every = _gather(mine, group)
    if any(g[0] != every[0][0] for g in every):
        raise TPCompileError(_nodes_message(_gather(graph, group), f"{entry}: the ranks captured different "
                                            f"programs ({graph_label})", SAME_MODEL.format(entry=entry)))
    if any(g[1] != every[0][1] for g in every):
        raise TPCompileError(_lines_message(_gather(plan, group), f"{entry}: the ranks sharded differently", "plan "
                                            "line", "pass the same plan=, sequence_parallel= and comm= on every "
                                            "rank"))
    if schedule is not None:
        why = schedule_difference([g[2] for g in every])
        if why is not None:
            raise TPCompileError(f"{entry}: {why}")
    return digest([mine[0], mine[1]])


def _first_unmatched(lines: list[str], other: Counter) -> Optional[tuple[int, str]]:
    """The first line of `lines` (its index and text) that the other graph's multiset of lines runs out of."""
    left = Counter(other)
    for i, line in enumerate(lines):
        if left[line] <= 0:
            return i, line
        left[line] -= 1
    return None


def _nodes_message(lists: list[list[str]], head: str, way_out: str) -> str:
    """The first node of each side (in its own graph order) that the other side's graph lacks, both quoted."""
    def say(hit: Optional[tuple[int, str]]) -> str:
        return "nothing the other lacks" if hit is None else f"node #{hit[0]} {hit[1].split(' ', 1)[1]!r}"
    ref = Counter(lists[0])
    for r, other in enumerate(lists[1:], start=1):
        if Counter(other) != ref:
            return (f"{head}: rank 0 has {say(_first_unmatched(lists[0], Counter(other)))}, rank {r} has "
                    f"{say(_first_unmatched(other, ref))} (rank 0 has {len(lists[0])} nodes, rank {r} {len(other)}); "
                    f"{way_out}")
    return f"{head}; {way_out}"


def _lines_message(lists: list[list[str]], head: str, what: str, way_out: str) -> str:
    """The first record where a rank's list differs from rank 0's, both sides quoted."""
    r, i = first_difference_at(lists)
    if r < 0:  # the digests differed, the lists do not: the records themselves changed between the two gathers
        return f"{head}; {way_out}"
    at = lambda ls: repr(ls[i]) if i < len(ls) else "nothing (its list ends there)"  # noqa: E731
    return (f"{head}: at {what} #{i} rank 0 has {at(lists[0])}, rank {r} has {at(lists[r])} (rank 0 has "
            f"{len(lists[0])} {what}s, rank {r} {len(lists[r])}); {way_out}")
