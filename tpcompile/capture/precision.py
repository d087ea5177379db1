"""Mixed precision at capture: the model captured with its parameters in the compute dtype, weights kept in float32.

A captured graph bakes in the dtypes it was traced with (a norm that computes in float32 casts back
to the dtype its input had at capture), so a graph to run in bfloat16 must be captured with bfloat16
parameters. `compute_twin` is the model's structure on the meta device with every floating
parameter in the compute dtype and every buffer as it is (FSDP2's MixedPrecisionPolicy casts
parameters, not buffers): capturing it costs no memory and changes nothing in the user's model.
`float32_masters` then gives a rank module's parameters float32 storage (the master weights the
optimizer updates), and `full_state` is the user's model's tensors by name, from which the masters
are filled.
"""
from __future__ import annotations

import copy
from typing import Any, Optional

import torch
from torch import nn

from tpcompile.errors import TPCompileError

__all__ = ["PRECISIONS", "compute_dtype", "compute_twin", "float32_masters", "full_state"]

PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(mixed_precision: Any) -> Optional[torch.dtype]:
    """The compute dtype of a mixed_precision switch (None, "bf16", "fp16"), or a TPCompileError."""
    if mixed_precision is None:
        return None
    if mixed_precision not in PRECISIONS:
        raise TPCompileError(f"mixed_precision={mixed_precision!r} is not one of None, 'bf16', 'fp16': 'bf16' computes "
                             f"in bfloat16 and 'fp16' in float16 with a loss scaler, both keeping float32 weights, "
                             f"optimizer state and gradient reductions")
    return PRECISIONS[mixed_precision]


def compute_twin(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The model's structure on meta: floating parameters in `dtype`, buffers in their own dtype; no data copied."""
    memo: dict[int, Any] = {}
    for _, t in model.named_parameters(remove_duplicate=False):
        if id(t) not in memo:
            like = dtype if t.is_floating_point() else t.dtype
            memo[id(t)] = nn.Parameter(torch.empty(t.shape, dtype=like, device="meta"), requires_grad=t.requires_grad)
    for _, t in model.named_buffers(remove_duplicate=False):
        memo.setdefault(id(t), torch.empty(t.shape, dtype=t.dtype, device="meta"))
    return copy.deepcopy(model, memo)


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of the model by name (non-persistent buffers and tied names too)."""
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    meta = [n for n, t in named if t.is_meta]
    if meta:
        raise TPCompileError(f"mixed precision needs the model's values, but {', '.join(meta[:3])} "
                             f"{'are' if len(meta) > 1 else 'is'} on the meta device; pass weights=")
    return {n: t.detach() for n, t in named}


def float32_masters(module: nn.Module) -> None:
    """Give every floating parameter of a meta module float32 storage of its shape (tied ones stay one)."""
    made: dict[int, nn.Parameter] = {}
    for path, owner in module.named_modules(remove_duplicate=False):
        for name, p in list(owner._parameters.items()):
            if p is None or not p.is_floating_point() or p.dtype == torch.float32:
                continue
            if not p.is_meta:
                raise TPCompileError(f"float32 master weights are made on the meta device; {path}.{name} is on "
                                     f"{p.device}")
            if id(p) not in made:
                made[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=torch.float32, device="meta"),
                                           requires_grad=p.requires_grad)
            owner._parameters[name] = made[id(p)]
