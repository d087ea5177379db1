"""Sharded checkpoints with torch.distributed.checkpoint, loadable at any world size.

Each rank writes its slices as DCP chunks of the *full* tensors, keyed by the original
model's names: the checkpoint's metadata holds every tensor's global shape and the offset of
each chunk, which is all a load needs to reshard (a different world size, or the plain
model through the stock `torch.distributed.checkpoint.load`). Segmented (fused q|k|v),
padded-vocabulary and shared kv-head slices become several chunks, or one written once.
"""
from __future__ import annotations

import os
from typing import Any, Optional, Union

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.fx import GraphModule

from tpcompile.errors import TPCompileError
from tpcompile.placement import rank_pieces

__all__ = ["load", "rank_state", "save"]

Path = Union[str, os.PathLike]


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


def _resolve(gm: GraphModule, sharded: Any, rank: Optional[int]) -> tuple[Any, int]:
    """The ShardedModel and rank behind a rank module."""
    meta = getattr(gm, "meta", {})
    sharded = sharded if sharded is not None else meta.get("tpcompile")
    rank = rank if rank is not None else meta.get("tpcompile_rank")
    if sharded is None or rank is None:
        raise TPCompileError("pass sharded= and rank= for a module that did not come from tpcompile.parallelize")
    return sharded, rank


def rank_state(gm: GraphModule, sharded: Any = None, rank: Optional[int] = None) -> dict[str, Any]:
    """Rank module's state as DCP values: whole tensors, or RankChunks of the full tensors."""
    own = getattr(gm, "dcp_state", None)
    if callable(own):  # a model that lays out its own chunks (tpcompile.hybrid's HybridModel)
        return own()
    sharded, rank = _resolve(gm, sharded, rank)
    ctx, ws = sharded._ctx, sharded.world_size
    state: dict[str, Any] = {}
    for name, t in gm.state_dict(keep_vars=True).items():
        t = t.detach()  # loads write into these views in place
        sl = ctx.slice_for(name)
        if sl is None:
            state[name] = t
        else:
            full = tuple(ctx.tensors[name].shape)
            state[name] = RankChunks(t, full, sl.dim, rank_pieces(sl, full[sl.dim], rank, ws))
    return state


def save(gm: GraphModule, path: Path, *, sharded: Any = None, rank: Optional[int] = None,
         group: Any = None) -> None:
    """Write this rank's slices into the DCP checkpoint directory `path` (call on every rank)."""
    dcp.save(rank_state(gm, sharded, rank), storage_writer=dcp.FileSystemWriter(str(path)),
             planner=_SavePlanner(), process_group=group)


def load(gm: GraphModule, path: Path, *, sharded: Any = None, rank: Optional[int] = None,
         group: Any = None, no_dist: bool = False) -> GraphModule:
    """Fill a rank module in place from a checkpoint saved at any world size; returns it.

    `no_dist=True` loads without a process group (each call reads only its own slices).
    """
    if not os.path.isdir(path):
        raise TPCompileError(f"checkpoint directory {str(path)!r} does not exist")
    with torch.no_grad():
        dcp.load(rank_state(gm, sharded, rank), storage_reader=dcp.FileSystemReader(str(path)),
                 planner=_LoadPlanner(), process_group=group, no_dist=no_dist)
    return gm
