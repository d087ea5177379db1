"""Per-rank weights: read only this rank's slices from a state dict or safetensors files."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch import nn
from torch.fx import GraphModule

from tpcompile.errors import TPCompileError
from tpcompile.placement import rank_pieces

__all__ = ["WeightSource", "allocate", "load_rank_weights", "open_weights", "retarget"]

Weights = Union[dict, str, os.PathLike, Iterable]


class WeightSource:
    """Named full-size tensors that can be read a slice at a time."""

    def __init__(self, tensors: Optional[dict] = None, files: Optional[dict[str, Path]] = None) -> None:
        self._tensors = tensors or {}
        self._files = files or {}  # tensor name -> the safetensors file holding it

    def __contains__(self, name: str) -> bool:
        return name in self._tensors or name in self._files

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored (global) shape of `name`."""
        if name in self._tensors:
            return tuple(self._tensors[name].shape)
        from safetensors import safe_open
        with safe_open(str(self._files[name]), framework="pt") as f:
            return tuple(f.get_slice(name).get_shape())

    def fresh(self, name: str) -> bool:
        """True when read() returns a new tensor (from a file) rather than a view of a given one."""
        return name not in self._tensors

    def read(self, name: str, dim: Optional[int] = None, start: int = 0, length: int = 0) -> torch.Tensor:
        """The whole tensor (dim None) or `length` entries from `start` along `dim`."""
        if name in self._tensors:
            t = self._tensors[name]
            return t if dim is None else t.narrow(dim, start, length)
        from safetensors import safe_open
        # Opened per read: the file's mapping (and the pages it touched) is released at once,
        # so resident memory stays about one slice above what the rank keeps.
        with safe_open(str(self._files[name]), framework="pt") as f:
            if dim is None:
                return f.get_tensor(name)
            piece = f.get_slice(name)
            ndim = len(piece.get_shape())
            return piece[tuple(slice(start, start + length) if d == dim else slice(None) for d in range(ndim))]


def open_weights(weights: Weights) -> WeightSource:
    """A WeightSource from a state dict, a .safetensors / .pt file, a directory, or a list of files."""
    if isinstance(weights, WeightSource):
        return weights
    if isinstance(weights, dict):
        return WeightSource(tensors=weights)
    paths = [Path(weights)] if isinstance(weights, (str, os.PathLike)) else [Path(p) for p in weights]
    files: list[Path] = []
    for p in paths:
        if p.is_dir():
            files += sorted(p.glob("*.safetensors"))
        elif p.exists():
            files.append(p)
        else:
            raise TPCompileError(f"weights file {str(p)!r} does not exist")
    if not files:
        raise TPCompileError(f"no .safetensors files in {[str(p) for p in paths]}")
    tensors: dict = {}
    index: dict[str, Path] = {}
    for f in files:
        if f.suffix == ".safetensors":
            from safetensors import safe_open
            with safe_open(str(f), framework="pt") as handle:
                index.update((k, f) for k in handle.keys())
        else:
            # weights_only: a checkpoint file can never run code; mmap: pages are read on demand
            tensors.update(torch.load(f, map_location="cpu", weights_only=True, mmap=True))
    return WeightSource(tensors, index)


def _local(src: WeightSource, key: str, like: torch.Tensor, global_shape: tuple, sl: Any,
           rank: int, ws: int, device: torch.device) -> torch.Tensor:
    """This rank's tensor for `key`, read slice by slice straight into its final storage."""
    stored = src.shape(key)
    if stored != tuple(global_shape):
        raise TPCompileError(f"weight {key!r} has shape {list(stored)} in the weights but "
                             f"{list(global_shape)} in the model; load weights of this model's config")
    pieces = None if sl is None else rank_pieces(sl, global_shape[sl.dim], rank, ws)
    if src.fresh(key) and (pieces is None or (len(pieces) == 1 and pieces[0][2] == like.shape[sl.dim])):
        # one read that is already a private tensor of the local shape: keep it, no second copy
        whole = src.read(key) if pieces is None else src.read(key, sl.dim, pieces[0][0], pieces[0][2])
        return whole.to(device=device, dtype=like.dtype).contiguous()
    # padded columns must be zeros, everything else is overwritten below
    make = torch.zeros if sl is not None and sl.padded else torch.empty
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
    ctx, ws = sharded._ctx, sharded.world_size
    device = torch.device(device) if device is not None else _default_device(gm)

    def make(name: str, old: torch.Tensor) -> Optional[torch.Tensor]:
        key = next((a for a in [name, *ctx.aliases(name)] if a in src), None)
        if key is None:
            return None if old.is_meta else old.detach().to(device)
        with torch.no_grad():
            return _local(src, key, old, tuple(ctx.tensors[name].shape), ctx.slice_for(name), rank, ws, device)

    missing = _rebuild(gm, device, make)
    if missing:
        raise TPCompileError(f"the weights lack {len(missing)} tensor(s) the model holds on the meta "
                             f"device: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}; "
                             f"add them to the state dict (non-persistent buffers too) or build "
                             f"those modules on a real device")
    return gm


def allocate(gm: GraphModule, *, device: Union[str, torch.device, None] = None) -> GraphModule:
    """Give every meta tensor of a rank module zero-filled storage of its (local) shape, tied ones once."""
    device = torch.device(device) if device is not None else _default_device(gm)
    _rebuild(gm, device, lambda name, old: torch.zeros(old.shape, dtype=old.dtype, device=device)
             if old.is_meta else old.detach().to(device))
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
    """Factory calls that capture baked onto the capture device (arange(..., device=meta)) run on new."""
    if old == new:
        return
    changed = False
    for node in gm.graph.nodes:
        dev = node.kwargs.get("device") if node.op == "call_function" else None
        if dev is not None and torch.device(dev) == old:
            node.update_kwarg("device", new)
            changed = True
    if changed:
        gm.recompile()
