"""`cond` and `map_impl` as a rank graph runs them: the eager meaning of torch's higher-order ops.

torch's own eager `cond` / `map_impl` trace their bodies with make_fx on every call that needs a
gradient (to build the backward), which is slow and not safe in threads (the simulator runs the
ranks as threads). These functions compute exactly what the ops' dense kernels compute, and
autograd records the body's ops themselves.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch


def run_cond(pred: Any, true_fn: Callable, false_fn: Callable, operands: Sequence[Any]) -> Any:
    """torch.cond: the true branch on the operands when pred holds, else the false branch."""
    return true_fn(*operands) if bool(pred) else false_fn(*operands)


def run_map(body: Callable, xs: Sequence[torch.Tensor], pos_args: Sequence[Any]) -> list:
    """map_impl: the body on each entry of the mapped operands' dim 0 (and the other operands whole), each of its
    outputs stacked along a new dim 0."""
    rows = [body(*entry, *pos_args) for entry in zip(*(x.unbind(0) for x in xs))]
    flat = [r if isinstance(r, (list, tuple)) else (r,) for r in rows]
    return [torch.stack(parts) for parts in zip(*flat)]
