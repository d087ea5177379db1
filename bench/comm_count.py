"""Count the collectives a rank executes, whoever issues them: torch.distributed, DTensor or tpcompile."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CommCounter", "summarize"]

# (namespace, op name) -> the collective it performs; anything else (barrier, wait_tensor) is not counted.
_KIND = {
    ("c10d", "allreduce_"): "all_reduce",
    ("c10d", "allreduce_coalesced_"): "all_reduce",
    ("c10d", "allgather_"): "all_gather",
    ("c10d", "_allgather_base_"): "all_gather",
    ("c10d", "allgather_into_tensor_coalesced_"): "all_gather",
    ("c10d", "reduce_scatter_"): "reduce_scatter",
    ("c10d", "_reduce_scatter_base_"): "reduce_scatter",
    ("c10d", "broadcast_"): "broadcast",
    ("c10d", "alltoall_"): "all_to_all",
    ("c10d", "alltoall_base_"): "all_to_all",
    ("tpcompile", "all_reduce"): "all_reduce",
    ("tpcompile", "all_gather"): "all_gather",
    ("tpcompile", "all_gather_replicated"): "all_gather",
    ("tpcompile", "reduce_scatter"): "reduce_scatter",
}
for _ns in ("_c10d_functional", "_c10d_functional_autograd"):
    _KIND.update({(_ns, "all_reduce"): "all_reduce", (_ns, "all_gather_into_tensor"): "all_gather",
                  (_ns, "reduce_scatter_tensor"): "reduce_scatter", (_ns, "broadcast"): "broadcast",
                  (_ns, "all_to_all_single"): "all_to_all"})
# c10d ops whose first argument is the output; their input (what this rank sends) is the second.
_OUTPUT_FIRST = {"allgather_", "_allgather_base_", "allgather_into_tensor_coalesced_",
                 "reduce_scatter_", "_reduce_scatter_base_", "alltoall_", "alltoall_base_"}


def _nbytes(value: Any) -> int:
    """Bytes of every tensor in value (a tensor or nested lists of tensors)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


class CommCounter(TorchDispatchMode):
    """While active, log (collective, bytes of this rank's input) for every collective op dispatched."""

    def __init__(self) -> None:
        """Start with an empty log."""
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        """Log a collective, then run the op unchanged."""
        # DTensor ops are let through first, so that the collectives they lower to are seen here.
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        name = func._schema.name.split("::")[-1]
        kind = _KIND.get((func.namespace, name))
        if kind is not None:
            sent = args[1] if func.namespace == "c10d" and name in _OUTPUT_FIRST else args[0]
            self.calls.append((kind, _nbytes(sent)))
        return func(*args, **(kwargs or {}))


def summarize(calls: list[tuple[str, int]]) -> dict[str, Any]:
    """{'counts': calls per collective, 'bytes': total bytes sent into them}."""
    counts: dict[str, int] = {}
    for kind, _ in calls:
        counts[kind] = counts.get(kind, 0) + 1
    return {"counts": counts, "bytes": sum(n for _, n in calls)}
