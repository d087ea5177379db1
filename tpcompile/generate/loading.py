"""`shard_generation(..., weights=...)`: each rank's graph filled from full-size weights, reading only its slices.

A model built under `torch.device("meta")` is captured without data (its cache buffers are meta
too). When a rank's generator is first built, its key/value cache is allocated zero-filled on the
rank's device and every other tensor is read from `weights` (a state dict, .safetensors / .pt
files or a directory of them, as tpcompile.parallelize takes) by checkpoint/weights.py, slice by
slice. The weights name tensors as the user's model does; in the captured module the model sits
under `model.` beside the cache (`kv.`), which `_UnderModel` strips.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch.fx import GraphModule

from tpcompile.checkpoint.weights import WeightSource, load_rank_weights, open_weights

MODEL_PREFIX = "model."


class _UnderModel(WeightSource):
    """The user's weights seen under the captured module's names (`model.<name>`)."""

    def __init__(self, inner: WeightSource) -> None:
        super().__init__()
        self.inner = inner

    @staticmethod
    def _key(name: str) -> Optional[str]:
        return name[len(MODEL_PREFIX):] if name.startswith(MODEL_PREFIX) else None

    def __contains__(self, name: str) -> bool:
        key = self._key(name)
        return key is not None and key in self.inner

    def where(self, name: str) -> str:
        return self.inner.where(self._key(name) or name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.inner.shape(self._key(name))

    def dtype(self, name: str) -> torch.dtype:
        return self.inner.dtype(self._key(name))

    def fresh(self, name: str) -> bool:
        return self.inner.fresh(self._key(name))

    def read(self, name: str, dim: Optional[int] = None, start: int = 0, length: int = 0) -> torch.Tensor:
        return self.inner.read(self._key(name), dim, start, length)


def default_device() -> torch.device:
    """Where a rank's loaded tensors go: cuda:LOCAL_RANK under NCCL, else the CPU (as tpcompile.parallelize)."""
    from tpcompile.runtime.parallelize import default_device as runtime_default
    return runtime_default()


def load_generation_rank(gm: GraphModule, sharded: Any, rank: int, weights: Any, cache_prefix: str,
                         device: Optional[torch.device]) -> GraphModule:
    """Rank `rank`'s graph with a zero-filled cache on `device` and the model's tensors read from `weights`."""
    target = torch.device(device) if device is not None else default_device()
    for name, buf in list(gm.named_buffers()):
        if name.startswith(cache_prefix):
            owner, _, leaf = name.rpartition(".")
            gm.get_submodule(owner)._buffers[leaf] = torch.zeros(buf.shape, dtype=buf.dtype, device=target)
    return load_rank_weights(gm, sharded, rank, _UnderModel(open_weights(weights)), device=target)
