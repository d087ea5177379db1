"""Per-rank weights: read only this rank's slices from a state dict or safetensors files."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch import nn
from torch.fx import GraphModule

from tpcompile.checkpoint.buffers import no_value_error, non_persistent
from tpcompile.checkpoint.dtypes import SAFETENSORS_DTYPES, check_cast
from tpcompile.checkpoint.files import load_state_file, safetensors_index, safetensors_open
from tpcompile.errors import TPCompileError
from tpcompile.placement import rank_pieces

__all__ = ["UNFILLED", "WeightSource", "allocate", "load_rank_weights", "open_weights", "retarget"]

Weights = Union[dict, str, os.PathLike, Iterable]


class WeightSource:
    """Named full-size tensors that can be read a slice at a time."""

    def __init__(self, tensors: Optional[dict] = None, files: Optional[dict[str, Path]] = None,
                 origin: Optional[dict[str, str]] = None) -> None:
        self._tensors = tensors or {}
        self._files = files or {}  # tensor name -> the safetensors file holding it
        self._origin = origin or {}  # tensor name -> the .pt file it came from

    def __contains__(self, name: str) -> bool:
        return name in self._tensors or name in self._files

    def where(self, name: str) -> str:
        """Where `name` is stored, for messages: its file, or the state dict."""
        if name in self._files:
            return f"weights file {str(self._files[name])!r}"
        return f"weights file {self._origin[name]!r}" if name in self._origin else "the weights state dict"

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored (global) shape of `name`."""
        if name in self._tensors:
            return tuple(self._tensors[name].shape)
        with safetensors_open(self._files[name], name) as f:
            return tuple(f.get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        """The stored dtype of `name`."""
        if name in self._tensors:
            return self._tensors[name].dtype
        with safetensors_open(self._files[name], name) as f:
            code = f.get_slice(name).get_dtype()
        if code not in SAFETENSORS_DTYPES:
            raise TPCompileError(f"{self.where(name)}: tensor {name!r} has dtype {code}, which tpcompile cannot "
                                 f"load; convert the file to float32 or bfloat16")
        return SAFETENSORS_DTYPES[code]

    def fresh(self, name: str) -> bool:
        """True when read() returns a new tensor (from a file) rather than a view of a given one."""
        return name not in self._tensors

    def read(self, name: str, dim: Optional[int] = None, start: int = 0, length: int = 0) -> torch.Tensor:
        """The whole tensor (dim None) or `length` entries from `start` along `dim`."""
        if name in self._tensors:
            t = self._tensors[name]
            return t if dim is None else t.narrow(dim, start, length)
        # Opened per read: the file's mapping (and the pages it touched) is released at once,
        # so resident memory stays about one slice above what the rank keeps.
        with safetensors_open(self._files[name], name) as f:
            if dim is None:
                return f.get_tensor(name)
            piece = f.get_slice(name)
            ndim = len(piece.get_shape())
            return piece[tuple(slice(start, start + length) if d == dim else slice(None) for d in range(ndim))]

    def check(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Raise naming the file and tensor unless the stored `key` has `shape` and loads into `dtype`."""
        stored = self.shape(key)
        if stored != tuple(shape):
            raise TPCompileError(f"{self.where(key)}: tensor {key!r} has shape {list(stored)} there but "
                                 f"{list(shape)} in the model; load weights of this model's config")
        check_cast(self.dtype(key), dtype, tensor=key, where=self.where(key))


def open_weights(weights: Weights) -> WeightSource:
    """A WeightSource from a state dict, a .safetensors / .pt file, a directory, or a list of files."""
    if isinstance(weights, WeightSource):
        return weights
    if isinstance(weights, dict):
        bad = next((k for k, v in weights.items() if not isinstance(v, torch.Tensor)), None)
        if bad is not None:
            raise TPCompileError(f"the weights state dict's entry {bad!r} is a {type(weights[bad]).__name__}, "
                                 f"not a tensor; pass model.state_dict() (a dict of tensors)")
        return WeightSource(tensors=weights)
    paths = [Path(weights)] if isinstance(weights, (str, os.PathLike)) else [Path(p) for p in weights]
    files: list[Path] = []
    for p in paths:
        if p.is_dir():
            if not (p / ".metadata").exists() and any(p.glob("*.distcp")):
                raise TPCompileError(f"checkpoint directory {str(p)!r} holds .distcp files but no .metadata: the "
                                     f"save did not finish (the metadata is written last); save it again or "
                                     f"load an earlier checkpoint")
            files += sorted(p.glob("*.safetensors"))
        elif p.exists():
            files.append(p)
        else:
            raise TPCompileError(f"weights file {str(p)!r} does not exist")
    if not files:
        raise TPCompileError(f"no .safetensors files in {[str(p) for p in paths]}")
    tensors: dict = {}
    index: dict[str, Path] = {}
    origin: dict[str, str] = {}
    for f in files:
        if f.suffix == ".safetensors":
            index.update((k, f) for k in safetensors_index(f))
        else:
            state = load_state_file(f)
            tensors.update(state)
            origin.update((k, str(f)) for k in state)
    return WeightSource(tensors, index, origin)


def _local(src: WeightSource, key: str, like: torch.Tensor, global_shape: tuple, sl: Any,
           rank: int, ws: int, device: torch.device) -> torch.Tensor:
    """This rank's tensor for `key`, read slice by slice straight into its final storage."""
    src.check(key, global_shape, like.dtype)
    pieces = None if sl is None else rank_pieces(sl, global_shape[sl.dim], rank, ws)
    if src.fresh(key) and (pieces is None or (len(pieces) == 1 and pieces[0][2] == like.shape[sl.dim])):
        # one read that is already a private tensor of the local shape: keep it, no second copy
        whole = src.read(key) if pieces is None else src.read(key, sl.dim, pieces[0][0], pieces[0][2])
        return whole.to(device=device, dtype=like.dtype).contiguous()
    # padded columns must be zeros, everything else is overwritten below
    make = torch.zeros if sl is not None and (sl.padding or sl.rank_cuts) else torch.empty
    out = make(like.shape, dtype=like.dtype, device=device)
    if pieces is None:
        out.copy_(src.read(key))
        return out
    for start, local, n in pieces:
        out.narrow(sl.dim, local, n).copy_(src.read(key, sl.dim, start, n))
    return out


def load_rank_weights(gm: GraphModule, sharded: Any, rank: int, weights: Weights, *,
                      device: Union[str, torch.device, None] = None) -> GraphModule:
    """Fill rank `rank`'s module (meta or real tensors) from full-size weights, reading only its slices.

    Tied parameters are created once; a tensor the weights lack keeps its current value
    unless it is on the meta device, which is an error naming it.
    """
    src = open_weights(weights)
    ws = sharded.world_size
    device = torch.device(device) if device is not None else _default_device(gm)

    def make(name: str, old: torch.Tensor) -> Optional[torch.Tensor]:
        key = next((a for a in [name, *sharded.aliases(name)] if a in src), None)
        if key is None:
            return None if old.is_meta else old.detach().to(device)
        with torch.no_grad():
            return _local(src, key, old, sharded.full_shape(name), sharded.slice_for(name), rank, ws, device)

    missing = _rebuild(gm, device, make)
    if missing:
        raise no_value_error(missing, non_persistent(sharded.captured), describe(weights))
    return gm


def describe(weights: Weights) -> str:
    """The weights as a message names them."""
    if isinstance(weights, dict):
        return "the weights state dict"
    if isinstance(weights, (str, os.PathLike)):
        return f"the weights {str(weights)!r}"
    return f"the weights {[str(w) for w in weights]}" if isinstance(weights, (list, tuple)) else "the weights"


UNFILLED = "tpcompile_unfilled"  # gm.meta key: the names of the tensors allocate() zero-filled (no value yet)


def allocate(gm: GraphModule, *, device: Union[str, torch.device, None] = None) -> GraphModule:
    """Give every meta tensor of a rank module zero-filled storage of its (local) shape, tied ones once.

    The names it filled are kept in gm.meta[UNFILLED], so a later load (tpcompile.dcp.load) can require
    a value for each of them instead of leaving zeros.
    """
    device = torch.device(device) if device is not None else _default_device(gm)
    held = list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False))
    names = {name for name, t in held if t.is_meta}
    _rebuild(gm, device, lambda name, old: torch.zeros(old.shape, dtype=old.dtype, device=device)
             if old.is_meta else old.detach().to(device))
    if names:
        gm.meta.setdefault(UNFILLED, set()).update(names)
    return gm


def _rebuild(gm: GraphModule, device: torch.device,
             make: Callable[[str, torch.Tensor], Optional[torch.Tensor]]) -> list[str]:
    """Replace every parameter and buffer by make(name, old), tied ones once; the names make left out."""
    made: dict[int, torch.Tensor] = {}
    missing: list[str] = []
    entries = [(n, t, True) for n, t in gm.named_parameters(remove_duplicate=False)]
    entries += [(n, t, False) for n, t in gm.named_buffers(remove_duplicate=False)]
    for name, old, is_param in entries:
        if id(old) not in made:
            new = make(name, old)
            if new is None:
                missing.append(name)
                continue
            made[id(old)] = nn.Parameter(new, requires_grad=old.requires_grad) if is_param else new
        _put(gm, name, made[id(old)], is_param)
    if any(t.is_meta for _, t, _ in entries):
        retarget(gm, torch.device("meta"), device)
    return missing


def _default_device(gm: GraphModule) -> torch.device:
    """Where real tensors go when no device is given: the module's own, CPU for meta."""
    for t in list(gm.parameters()) + list(gm.buffers()):
        if not t.is_meta:
            return t.device
    return torch.device("cpu")


def _put(root: nn.Module, name: str, value: torch.Tensor, is_param: bool) -> None:
    """Replace the parameter or buffer at dotted `name`, keeping a buffer's persistence."""
    prefix, _, leaf = name.rpartition(".")
    mod = root.get_submodule(prefix) if prefix else root
    if is_param:
        mod._parameters[leaf] = value
    else:
        mod._buffers[leaf] = value


def retarget(gm: GraphModule, old: torch.device, new: torch.device) -> None:
    """Calls that capture baked onto the capture device (arange(..., device=meta), x.to(meta)) run on new."""
    if old == new:
        return
    changed = False
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        dev = node.kwargs.get("device")
        if dev is not None and torch.device(dev) == old:
            node.update_kwarg("device", new)
            changed = True
        for i, a in enumerate(node.args):  # a positional device: aten.to.device(x, device, dtype)
            if isinstance(a, torch.device) and a == old:
                node.update_arg(i, new)
                changed = True
    if changed:
        gm.recompile()
