"""Inputs agree: the ranks of a tensor-parallel group compare fingerprints of a call's inputs before computing.

Every rank of a tensor-parallel group must be given the same inputs: each rank computes its slice of
one result, so ranks fed different batches (an unseeded `torch.randint` on each rank, a data loader
shuffled per rank) return a silent mixture. `InputCheck` is called with a call's arguments before the
rank runs: each rank reduces its inputs to four float64 numbers (how many leaves, a hash of their
structure, shapes, dtypes and non-tensor values, and two position-weighted sums of the tensors'
values), the group all-gathers them in one small collective, and only when they differ are the
per-input details exchanged to say which input differs on which ranks. Modes: "first" (the first
call only, the default), "always" (every call; it costs one small all-gather and a device sync per
call), "never".
"""
from __future__ import annotations

import hashlib
import math
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from tpcompile.errors import TPCompileError

__all__ = ["CHECK_INPUTS", "InputCheck", "check_inputs_mode"]

CHECK_INPUTS = ("first", "always", "never")
SUM_RTOL = 1e-9  # the same values summed on two ranks agree to their last bits
_weights: dict[tuple[int, str], torch.Tensor] = {}


def check_inputs_mode(mode: Any) -> str:
    """The mode, or a TPCompileError listing the accepted ones."""
    if mode not in CHECK_INPUTS:
        raise TPCompileError(f"check_inputs={mode!r} is not one of {', '.join(map(repr, CHECK_INPUTS))}: 'first' "
                             f"compares the first call's inputs across the group, 'always' every call's, 'never' none")
    return mode


def _position_weights(n: int, device: torch.device) -> torch.Tensor:
    """1, 2, ..., n in float64 (cached): a sum weighted by position tells a batch from its permutation."""
    key = (n, str(device))
    if key not in _weights:
        if len(_weights) > 16:
            _weights.clear()
        _weights[key] = torch.arange(1, n + 1, dtype=torch.float64, device=device)
    return _weights[key]


def _leaf_sums(t: torch.Tensor) -> torch.Tensor:
    """(sum, position-weighted sum) of a tensor's values in float64."""
    flat = t.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    wide = flat.to(torch.float64)
    return torch.stack([wide.sum(), (wide * _position_weights(wide.numel(), wide.device)).sum()])


def _close(a: Sequence[float], b: Sequence[float]) -> bool:
    """Two fingerprints of one input agree (within SUM_RTOL)."""
    return all(math.isclose(x, y, rel_tol=SUM_RTOL) for x, y in zip(a, b))


def _describe(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"{'x'.join(map(str, v.shape)) or 'scalar'} {str(v.dtype).removeprefix('torch.')}"
    return repr(v)


class InputCheck:
    """Compares each checked call's inputs across the ranks of `group` (see the module docstring)."""

    def __init__(self, group: Any, *, mode: str = "first", names: Optional[Sequence[str]] = None,
                 where: str = "this rank module") -> None:
        self.group, self.mode, self.names, self.where = group, check_inputs_mode(mode), names, where
        self.calls = 0

    def __call__(self, args: tuple, kwargs: Optional[dict] = None) -> None:
        """Raise a TPCompileError on every rank of the group unless all were given the same inputs."""
        self.calls += 1
        if self.mode == "never" or (self.mode == "first" and self.calls > 1):
            return
        if dist.get_world_size(self.group) == 1:
            return
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs or {})))
        tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.group) == "nccl" \
            else torch.device("cpu")
        shape = repr((str(spec), [_describe(v) for v in leaves]))
        structure = int(hashlib.sha256(shape.encode()).hexdigest()[:13], 16)  # 52 bits: exact in float64
        sums = torch.stack([_leaf_sums(t).to(device) for t in tensors]) if tensors else \
            torch.zeros(0, 2, dtype=torch.float64, device=device)
        rank_w = torch.arange(1, len(tensors) + 1, dtype=torch.float64, device=device)[:, None]
        summary = torch.cat([torch.tensor([len(leaves), structure], dtype=torch.float64, device=device),
                             (sums * rank_w).sum(0)])
        parts = [torch.empty_like(summary) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, summary, group=self.group)
        rows = torch.stack(parts)
        ref = rows[0:1]
        same = (rows[:, :2] == ref[:, :2]).all() & ((rows[:, 2:] - ref[:, 2:]).abs()
                                                     <= SUM_RTOL * (rows[:, 2:].abs() + ref[:, 2:].abs())).all()
        if bool(same):
            return
        mine = [(self._name(path, i), _describe(v), tuple(_leaf_sums(v).tolist()) if isinstance(v, torch.Tensor)
                 else None) for i, (path, v) in enumerate(pytree.tree_flatten_with_path((tuple(args),
                                                                                         dict(kwargs or {})))[0])]
        every: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(every, mine, group=self.group)
        raise TPCompileError(self._message(every))

    def _name(self, path: Any, i: int) -> str:
        """An input's name: the model's parameter name where known, else where it sits in the call."""
        if self.names is not None and i < len(self.names):
            return self.names[i]
        where, *inner = path  # (args, kwargs) first
        head = f"argument {inner[0].idx}" if where.idx == 0 and inner else (str(inner[0].key) if inner else "?")
        return head + pytree.keystr(tuple(inner[1:]))

    def _message(self, every: list) -> str:
        """Which input differs on which ranks, with the numbers that differ."""
        ref = every[0]
        for r, other in enumerate(every[1:], start=1):
            if len(other) != len(ref):
                return self._say(f"rank 0 passes {len(ref)} inputs, rank {r} {len(other)}")
            for k, ((name, a, sa), (_, b, sb)) in enumerate(zip(ref, other)):
                if a != b:
                    return self._say(f"input {name} is {a} on rank 0 but {b} on rank {r}")
                if sa is not None and sb is not None and not _close(sa, sb):
                    bad = [q for q, o in enumerate(every) if not _close(o[k][2], sa)]
                    return self._say(f"input {name} ({a}) holds other values on rank{'s' if len(bad) > 1 else ''} "
                                     f"{', '.join(map(str, bad))} than on rank 0 (sum {sb[0]:.8g} vs {sa[0]:.8g})")
        return self._say("the inputs' fingerprints differ between ranks")

    def _say(self, what: str) -> str:
        return (f"{self.where}: the ranks of the tensor-parallel group were given different inputs: {what}. Every "
                f"rank of a group computes its slice of one result, so all must get the same inputs: draw them from "
                f"a generator seeded alike on every rank (torch.Generator().manual_seed(step)), or broadcast them "
                f"from the group's first rank (torch.distributed.broadcast). check_inputs='never' turns this check "
                f"off")
