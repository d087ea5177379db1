"""A DCP checkpoint checked against the model before any tensor is read, and DCP's own failures in words.

Everything here reads only the checkpoint's `.metadata` and the sizes of its files, so a truncated
checkpoint, or one of another model or dtype, fails with a TPCompileError naming the directory and
the tensors instead of torch's CheckpointException (a BaseException, which `except Exception` misses).
"""
from __future__ import annotations

import os
import traceback
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from tpcompile.checkpoint.buffers import no_value_error
from tpcompile.checkpoint.dtypes import cast_problem
from tpcompile.errors import TPCompileError

__all__ = ["OPTIM_PREFIX", "RNG_PREFIX", "Reader", "Want", "agree", "checkpoint_error", "check_files", "compare",
           "read_metadata"]

_SHOWN = 5  # tensors named per kind of mismatch
# Training state beside the weights (tpcompile.dcp.save(..., optimizer=...)): a parameter's optimizer state is
# `optim.state.<parameter>.<key>` (the names stock DCP gives a flattened get_optimizer_state_dict); RNG states `rng.*`.
OPTIM_PREFIX = "optim.state."
RNG_PREFIX = "rng."


@dataclass(frozen=True)
class Want:
    """A tensor the model would load: its full shape and dtype, and what a checkpoint lacking it means."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    buffer: bool = False  # a buffer the checkpoint lacks keeps its value, if it has one
    valued: bool = True  # False: built on the meta device, so only the checkpoint can give it a value
    optional: bool = False  # a non-persistent buffer: loaded when the checkpoint holds it, never required


def read_metadata(path: str) -> Metadata:
    """The checkpoint's metadata, or a TPCompileError naming its .metadata file when it is missing or garbled."""
    meta = os.path.join(path, ".metadata")
    if not os.path.isfile(meta):
        raise TPCompileError(f"checkpoint directory {path!r} has no .metadata file: it is not a DCP checkpoint, or "
                             f"its save did not finish (the metadata is written last); save it again or load an "
                             f"earlier checkpoint")
    try:
        md = FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001  (unpickling a damaged file raises many types)
        raise TPCompileError(f"checkpoint {meta!r} cannot be read ({type(e).__name__}: {e}): the file is damaged "
                             f"or cut short; save the checkpoint again or load an earlier one") from e
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise TPCompileError(f"checkpoint {meta!r} holds a {type(md).__name__}, not DCP metadata; save the "
                             f"checkpoint again with tpcompile.dcp.save or torch.distributed.checkpoint.save")
    return md


def check_files(path: str, md: Metadata) -> None:
    """Raise naming the file and a tensor in it when a data file the metadata lists is missing or too short."""
    stored: dict[str, list[tuple[int, int, str]]] = {}  # file -> (start, end, tensor) of what it holds
    for index, info in (md.storage_data or {}).items():
        start = int(info.offset)
        stored.setdefault(info.relative_path, []).append((start, start + int(info.length), index.fqn))
    for rel, items in sorted(stored.items()):
        file = os.path.join(path, rel)
        if not os.path.isfile(file):
            first = min(items)[2]
            raise TPCompileError(f"checkpoint {path!r} is incomplete: its data file {rel} is missing (it holds "
                                 f"tensor {first!r} and {len(items) - 1} more chunk(s)); copy the whole directory, "
                                 f"or save it again")
        size = os.path.getsize(file)
        cut = [item for item in items if item[1] > size]
        if cut:
            _, end, tensor = min(cut)
            raise TPCompileError(f"checkpoint {path!r} is truncated: {rel} has {size} bytes but tensor {tensor!r} "
                                 f"is stored up to byte {end}; copy the file again, or save the checkpoint again")


class Reader(FileSystemReader):
    """FileSystemReader whose read failures name the data file and the tensor whose bytes could not be read."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Any:
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for rel, items in per_file.items():
            try:
                super().read_data(replace(plan, items=items), planner).wait()
            except TPCompileError:
                raise
            except Exception as e:  # noqa: BLE001  (torch.load of damaged bytes raises many types)
                raise self._damaged(rel, items, plan, planner, e) from e
        done: Future = Future()
        done.set_result(None)
        return done

    def _damaged(self, rel: str, items: list[Any], plan: LoadPlan, planner: LoadPlanner,
                 e: Exception) -> TPCompileError:
        """The error naming the first tensor of `rel` that cannot be read (each one is read again to find it)."""
        bad = items[0]
        for item in items:
            try:
                super().read_data(replace(plan, items=[item]), planner).wait()
            except Exception:  # noqa: BLE001
                bad = item
                break
        # the first sentence only: torch.load's advice to retry with weights_only=False does not apply here
        first = (str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0]
        return TPCompileError(f"checkpoint {str(self.path)!r}: tensor {bad.storage_index.fqn!r} cannot be read "
                              f"from {rel} ({type(e).__name__}: {first}); the file is damaged: copy it again, "
                              f"or save the checkpoint again")


def _listed(items: list[str]) -> str:
    """The first few items, and how many more."""
    more = f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return ", ".join(items[:_SHOWN]) + more


def _is_known(key: str, known: set[str]) -> bool:
    """True for a tensor of the model, the optimizer state of one of its parameters, or an RNG state."""
    if key.startswith(OPTIM_PREFIX):
        return key[len(OPTIM_PREFIX):].rpartition(".")[0] in known
    return key in known or key.startswith(RNG_PREFIX)


def compare(path: str, md: Metadata, wants: dict[str, Want], known: set[str]) -> tuple[str, set[str]]:
    """('' or what does not match, names to leave out of the load) for this rank's tensors against the checkpoint.

    `known` holds every name of the whole model (all ranks and stages): a checkpoint entry outside it
    (and not the optimizer state of one of them, nor an RNG state) is a tensor of another model.
    Non-tensor (pickled) entries are not compared.
    """
    stored = {k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    missing, unvalued, shapes, skip = [], [], [], set()
    for name, want in wants.items():
        entry = stored.get(name)
        if entry is None:
            skip.add(name)
            if not want.valued:
                unvalued.append(name)
            elif not (want.buffer or want.optional):
                missing.append(f"{name} {list(want.shape)}")
        elif tuple(entry.size) != tuple(want.shape):
            shapes.append(f"{name} {list(entry.size)} in the checkpoint vs {list(want.shape)} in the model")
    extra = [f"{k} {list(v.size)}" for k, v in stored.items() if not _is_known(k, known)]
    parts = [f"{len(missing)} tensor(s) of the model are not in it: {_listed(missing)}" if missing else "",
             f"{len(extra)} tensor(s) in it are not in the model: {_listed(extra)}" if extra else "",
             f"{len(shapes)} tensor(s) have other shapes: {_listed(shapes)}" if shapes else ""]
    parts = [p for p in parts if p]
    if parts:
        return (f"checkpoint {path!r} is not of this model: {'; '.join(parts)}. Load a checkpoint saved from this "
                f"model and config (tpcompile.dcp.load reshards across world sizes and layouts, not across "
                f"models)"), skip
    if unvalued:
        return str(no_value_error(unvalued, {n for n in unvalued if wants[n].optional},
                                  f"checkpoint {path!r}")), skip
    for name, want in wants.items():
        if name in stored:
            problem = cast_problem(stored[name].properties.dtype, want.dtype, tensor=name,
                                   where=f"checkpoint {path!r}")
            if problem:
                return problem, skip
    return "", skip


def agree(problem: str, group: Any, no_dist: bool) -> None:
    """Raise on every rank when any rank found a problem, so no rank waits in a load its peers left."""
    if not no_dist and dist.is_available() and dist.is_initialized():
        every: list[Optional[str]] = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, problem, group=group)
        problem = next((p for p in every if p), "")
        if problem and not every[dist.get_rank(group)]:
            problem = f"{problem} (found by another rank)"
    if problem:
        raise TPCompileError(problem)


def checkpoint_error(path: str, exc: BaseException, action: str) -> TPCompileError:
    """A TPCompileError from torch's CheckpointException: the directory and every rank's cause in words."""
    failures = getattr(exc, "failures", None) or {}
    ours = {str(err) for err, _ in failures.values() if isinstance(err, TPCompileError)}
    if len(ours) == 1 and len(ours) == len({str(err) for err, _ in failures.values()}):
        return TPCompileError(ours.pop())  # every rank failed alike, in words already
    causes = []
    for rank, (err, _) in sorted(failures.items()):
        if isinstance(err, TPCompileError):  # raised by our planners: already in words
            causes.append(f"rank {rank}: {err}")
            continue
        where = ""
        if isinstance(err, FileNotFoundError) and err.filename:
            where = f" ({os.path.basename(str(err.filename))} is missing)"
        first = traceback.format_exception_only(type(err), err)[-1].strip().splitlines()[0]
        causes.append(f"rank {rank}: {first}{where}")
    said = "; ".join(causes) or str(exc).splitlines()[0]
    way = ("check that the directory can be created and written (a path, permissions, free space)"
           if action == "write" else "a damaged or cut file raises this: save the checkpoint again or load an "
           "earlier one")
    return TPCompileError(f"could not {action} checkpoint {path!r}: {said}; {way}")
