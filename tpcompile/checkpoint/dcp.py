"""Sharded checkpoints with torch.distributed.checkpoint, loadable at any world size.

Each rank writes its slices as DCP chunks of the *full* tensors, keyed by the original
model's names: the checkpoint's metadata holds every tensor's global shape and the offset of
each chunk, which is all a load needs to reshard (a different world size, or the plain
model through the stock `torch.distributed.checkpoint.load`). Segmented (fused q|k|v),
padded-vocabulary and shared kv-head slices become several chunks, or one written once.
What is saved is what the model's own state_dict() holds: non-persistent buffers are neither
written nor required. A load checks the checkpoint first (dcp_checks.py) and raises a
TPCompileError naming the directory, file and tensors for anything damaged or mismatched.
This is the tensor layer; train_state.py (tpcompile.dcp.save/load) adds the optimizer, the step
and RNG states, and the marker that makes a checkpoint complete.
"""
from __future__ import annotations

import contextlib
import functools
import os
import warnings
from typing import Any, Callable, Iterator, Optional, Union

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch import nn
from torch.fx import GraphModule

from tpcompile.checkpoint.buffers import non_persistent
from tpcompile.checkpoint.dcp_checks import Reader, Want, agree, check_files, checkpoint_error, compare, read_metadata
from tpcompile.checkpoint.record import read_record
from tpcompile.checkpoint.weights import UNFILLED, allocate
from tpcompile.errors import TPCompileError
from tpcompile.placement import rank_pieces

__all__ = ["Group", "RankChunks", "is_plain", "load", "rank_state", "read", "resolve", "weight_groups", "write"]

Path = Union[str, os.PathLike]
Group = tuple[tuple[str, ...], dict[str, Any], Want]  # (names of one tensor, {name: DCP value}, what it needs)


class RankChunks:
    """One rank's pieces of a full tensor, each a view of its local tensor at a global offset."""

    def __init__(self, local: torch.Tensor, global_shape: tuple[int, ...], dim: int,
                 pieces: list[tuple[int, int, int]]) -> None:
        self.global_shape = torch.Size(global_shape)
        self.chunks: list[tuple[torch.Size, torch.Tensor]] = []
        for start, at, n in pieces:
            offsets = [0] * len(global_shape)
            offsets[dim] = start
            self.chunks.append((torch.Size(offsets), local.narrow(dim, at, n)))

    @classmethod
    def of(cls, global_shape: tuple[int, ...], chunks: list[tuple[tuple[int, ...], torch.Tensor]]) -> "RankChunks":
        """The chunks given directly: (offset in the full tensor, view of this rank's storage) pairs."""
        out = cls.__new__(cls)
        out.global_shape = torch.Size(global_shape)
        out.chunks = [(torch.Size(offsets), view) for offsets, view in chunks]
        return out

    def size(self) -> torch.Size:
        """The full tensor's shape (DCP checks it against the checkpoint)."""
        return self.global_shape

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=offsets, sizes=view.size()),
                              properties=TensorProperties.create_from_tensor(view),
                              size=self.global_shape))
                for offsets, view in self.chunks]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=offsets, sizes=view.size()) for offsets, view in self.chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, view in self.chunks:
            if offsets == index.offset:
                return view
        raise TPCompileError(f"{index.fqn}: this rank holds no chunk at offset {list(index.offset or [])}")


def _lookup(state: dict, index: MetadataIndex) -> Optional[torch.Tensor]:
    obj = state.get(index.fqn)
    return obj.__get_tensor_shard__(index) if isinstance(obj, RankChunks) else None


class _SavePlanner(DefaultSavePlanner):
    """The default planner, finding a RankChunks' piece by its offset."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        found = _lookup(self.state_dict, index)
        return found if found is not None else super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    """The default planner, with RankChunks targets and no pickled objects."""

    def set_up_planner(self, state_dict: dict, metadata: Any = None, is_coordinator: bool = False) -> None:
        chunks = {k: v for k, v in state_dict.items() if isinstance(v, RankChunks)}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        # the default set-up replaces values it does not know (our RankChunks) with None
        state_dict.update(chunks)
        self.state_dict.update(chunks)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        found = _lookup(self.state_dict, index)
        return found if found is not None else super().lookup_tensor(index)

    def load_bytes(self, read_item: Any, value: Any) -> None:
        # Only tensors are saved; a pickled object in a checkpoint would run code on load.
        raise TPCompileError(f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object; "
                             f"tpcompile loads tensors only")


def resolve(gm: GraphModule, sharded: Any, rank: Optional[int]) -> tuple[Any, int]:
    """The ShardedModel and rank behind a rank module."""
    meta = getattr(gm, "meta", {})
    sharded = sharded if sharded is not None else meta.get("tpcompile")
    rank = rank if rank is not None else meta.get("tpcompile_rank")
    if sharded is None or rank is None:
        raise TPCompileError("pass sharded= and rank= for a module that did not come from tpcompile.parallelize")
    return sharded, rank


def is_plain(model: nn.Module, sharded: Any) -> bool:
    """True for a module tpcompile did not shard: it is saved and loaded whole, as stock DCP of its state_dict()."""
    return (sharded is None and not isinstance(model, GraphModule) and not callable(getattr(model, "dcp_state", None))
            and isinstance(model, nn.Module))


def rank_state(gm: GraphModule, sharded: Any = None, rank: Optional[int] = None) -> dict[str, Any]:
    """Rank module's saved state as DCP values: whole tensors, or RankChunks of the full tensors.

    Non-persistent buffers (rotary inv_freq) are left out, as the model's own state_dict() leaves them out.
    """
    own = getattr(gm, "dcp_state", None)
    if callable(own):  # a model that lays out its own chunks (tpcompile.hybrid's HybridModel)
        return own()
    if is_plain(gm, sharded):
        return {name: t.detach() for name, t in gm.state_dict(keep_vars=True).items()}
    sharded, rank = resolve(gm, sharded, rank)
    skipped = non_persistent(sharded.captured)
    return {name: value for name, value in _rank_values(gm, sharded, rank).items() if name not in skipped}


def _rank_values(gm: GraphModule, sharded: Any, rank: int) -> dict[str, Any]:
    """Every tensor of a rank module as a DCP value, keyed by the original model's names."""
    ws = sharded.world_size
    state: dict[str, Any] = {}
    for name, t in gm.state_dict(keep_vars=True).items():
        t = t.detach()  # loads write into these views in place
        sl = sharded.slice_for(name)
        if sl is None:
            state[name] = t
        else:
            full = sharded.full_shape(name)
            state[name] = RankChunks(t, full, sl.dim, rank_pieces(sl, full[sl.dim], rank, ws))
    return state


def _grouped(tensors: dict[str, torch.Tensor], values: dict[str, Any], buffers: set[str], skipped: set[str],
             unfilled: set[str]) -> list[Group]:
    """The tensors to load, the names of one (tied) tensor together, each with what it needs."""
    names: dict[int, list[str]] = {}
    for name, t in tensors.items():
        names.setdefault(id(t), []).append(name)
    groups = []
    for group in names.values():
        first = group[0]
        want = Want(tuple(values[first].size()), tensors[first].dtype, buffer=first in buffers,
                    valued=first not in unfilled, optional=first in skipped)
        groups.append((tuple(group), {n: values[n] for n in group}, want))
    return groups


def _module_tensors(gm: nn.Module) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Every parameter and buffer under each of its names, and the buffers' names."""
    tensors = dict(gm.named_parameters(remove_duplicate=False))
    buffers = dict(gm.named_buffers(remove_duplicate=False))
    tensors.update(buffers)
    return tensors, set(buffers)


def weight_groups(model: Any, sharded: Any = None,
                  rank: Optional[int] = None) -> tuple[list[Group], set[str], Callable[[], None]]:
    """A model's tensors to load, every name of the whole model, and what to run after the load."""
    if callable(getattr(model, "dcp_load_groups", None)):  # a model that lays out its own chunks (a HybridModel)
        return model.dcp_load_groups()
    tensors, buffers = _module_tensors(model)
    if is_plain(model, sharded):
        on_meta = [n for n, t in tensors.items() if t.is_meta]
        if on_meta:
            raise TPCompileError(f"{type(model).__name__} holds {on_meta[0]} on the meta device (no storage to load "
                                 f"into); build it on a real device, or load it with parallelize(weights=...)")
        skipped = non_persistent(model)
        values = {n: t.detach() for n, t in tensors.items()}
        return _grouped(tensors, values, buffers, skipped, set()), set(model.state_dict()) | skipped, lambda: None
    sharded, rank = resolve(model, sharded, rank)
    if any(t.is_meta for t in tensors.values()):
        allocate(model)  # a rank module of a model built on meta: storage first, values from the checkpoint
        tensors, buffers = _module_tensors(model)
    skipped = non_persistent(sharded.captured)
    groups = _grouped(tensors, _rank_values(model, sharded, rank), buffers, skipped, model.meta.get(UNFILLED, set()))
    # then every zero-filled tensor holds a value
    return groups, set(sharded.captured.state_dict()) | skipped, functools.partial(model.meta.pop, UNFILLED, None)


More = Callable[[Metadata, Optional[dict]], dict[str, tuple[Any, Want]]]


@contextlib.contextmanager
def _quiet(no_dist: bool) -> Iterator[None]:
    """Silence DCP's note that it runs in one process when that is what the caller asked for."""
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def write(state: dict[str, Any], path: str, *, group: Any = None, no_dist: bool = False) -> None:
    """Write DCP values (tensors and RankChunks) into the checkpoint directory `path`, on every rank."""
    try:
        with _quiet(no_dist):
            dcp.save(state, storage_writer=dcp.FileSystemWriter(path), planner=_SavePlanner(), process_group=group,
                     no_dist=no_dist)
    except CheckpointException as e:  # a BaseException: callers' `except Exception` would miss it
        raise checkpoint_error(path, e, "write") from None


def read(path: str, groups: list[Group], known: set[str], *, group: Any = None, no_dist: bool = False,
         more: Optional[More] = None) -> Optional[dict]:
    """Check the checkpoint against what this rank loads (every rank learns any rank's finding), then read it.

    `more(metadata, record)` adds tensors that depend on the checkpoint (optimizer state, RNG states).
    Returns the checkpoint's JSON record (None for weights alone); an unfinished save raises.
    """
    problem, state, record = "", {}, None
    try:
        record = read_record(path)
        md = read_metadata(path)
        check_files(path, md)
        stored = md.state_dict_metadata
        chosen: dict[str, tuple[Any, Want]] = {}
        for names, values, want in groups:  # a tied tensor loads once, by a name the checkpoint has
            name = next((n for n in names if n in stored), names[0])
            chosen[name] = (values[name], want)
        if more is not None:
            chosen.update(more(md, record))
        problem, skip = compare(path, md, {n: w for n, (_, w) in chosen.items()}, known)
        state = {n: v for n, (v, _) in chosen.items() if n not in skip}
    except TPCompileError as e:
        problem = str(e)
    agree(problem, group, no_dist)
    try:
        with torch.no_grad(), _quiet(no_dist):
            dcp.load(state, storage_reader=Reader(path), planner=_LoadPlanner(), process_group=group, no_dist=no_dist)
    except CheckpointException as e:
        raise checkpoint_error(path, e, "load") from None
    return record


def load(gm: Any, path: Path, *, sharded: Any = None, rank: Optional[int] = None, group: Any = None,
         no_dist: bool = False) -> Any:
    """Fill a model's weights in place from a checkpoint saved at any world size or layout; returns the model.

    The weights alone (parallelize(weights=...), parallelize_train(weights=...)); tpcompile.dcp.load also
    restores the optimizer, the step and RNG states. The checkpoint is checked against the model first
    (finished, files present and whole, the same tensors, shapes, and dtypes that load without loss);
    buffers it lacks keep their values unless they have none (built on meta). `no_dist=True` loads
    without a process group (each call reads only its own slices).
    """
    path = str(path)
    if not os.path.isdir(path):
        raise TPCompileError(f"checkpoint directory {path!r} does not exist")
    groups, known, finish = weight_groups(gm, sharded, rank)
    read(path, groups, known, group=group, no_dist=no_dist)
    finish()
    return gm
