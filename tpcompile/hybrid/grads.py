"""Gradients across the mesh: tied weights in several stages, and the global gradient norm.

A weight used in two pipeline stages (a tied embedding and LM head) has one copy per stage;
after backward each copy holds only its own stage's part of the gradient, so the copies' gradients
are summed over the pipeline ranks holding them (a subgroup of "pp" per (dp, tp) position), and
AdamW then moves every copy alike. The global norm sums each distinct gradient element's square
exactly once: a tensor-parallel-replicated parameter on TP rank 0 only (the first rank of each
shared piece), a DDP replica on DP rank 0 only (FSDP shards are disjoint and all count), a tied
weight in its first stage only; the sums are then added over "tp", "dp" and "pp", so every rank
clips with the same coefficient and replicas stay equal.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from tpcompile.errors import TPCompileError
from tpcompile.hybrid.checkpoint import TensorSpec, rank_chunks


@dataclass
class LocalParam:
    """One parameter copy this rank holds."""

    stage: int  # the pipeline stage whose module holds it
    param: nn.Parameter  # the module's parameter (a DTensor under FSDP)
    spec: TensorSpec


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank's own storage of a plain tensor or a DTensor (a view; in-place changes reach the DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


class TiedGrads:
    """Sums the gradients of weights held by several stages over the pipeline ranks that hold them."""

    def __init__(self, holders: dict[str, list[int]], mesh: DeviceMesh) -> None:
        """`holders`: every parameter name -> the stages holding a copy (the same on every rank)."""
        pp = mesh["pp"].size()
        self.first = {name: stages[0] for name, stages in holders.items()}
        self.tied = sorted(n for n, stages in holders.items() if len(stages) > 1)
        self.groups: dict[str, Any] = {}
        made: dict[tuple[int, ...], Any] = {}
        for name in self.tied:
            ranks = tuple(sorted({s % pp for s in holders[name]}))
            if len(ranks) > 1 and ranks not in made:  # every rank creates every subgroup, in one order
                made[ranks] = _pp_subgroup(mesh, ranks)
            self.groups[name] = made.get(ranks)

    def snapshot(self, params: list[LocalParam]) -> dict[int, torch.Tensor]:
        """The tied copies' gradients before a step (what earlier steps accumulated, equal on every copy)."""
        return {id(lp.param): local_tensor(lp.param.grad).clone() for lp in params
                if lp.spec.name in self.groups and lp.param.grad is not None}

    def sync(self, params: list[LocalParam], before: dict[int, torch.Tensor]) -> None:
        """Add every copy's new gradient (since `before`) to every copy of the same tied weight."""
        for name in self.tied:
            copies = [lp.param for lp in params if lp.spec.name == name]
            if not copies:
                continue
            for p in copies:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            grads = [local_tensor(p.grad) for p in copies]
            new = [g - before[id(p)] if id(p) in before else g.clone() for p, g in zip(copies, grads)]
            total = new[0]
            for g in new[1:]:
                total.add_(g)
            if self.groups[name] is not None:
                dist.all_reduce(total, group=self.groups[name])
            for p, g in zip(copies, grads):
                g.copy_(before[id(p)] + total if id(p) in before else total)


def _pp_subgroup(mesh: DeviceMesh, pp_ranks: tuple[int, ...]) -> Any:
    """This rank's group of the given pipeline ranks at its own (dp, tp) position."""
    grid = mesh.mesh  # (pp, dp, tp) global ranks
    lists = [[int(grid[p, d, t]) for p in pp_ranks] for d in range(grid.shape[1]) for t in range(grid.shape[2])]
    mine, _ = dist.new_subgroups_by_enumeration(lists)
    return mine


def _counted(lp: LocalParam, first_stage: int, tp_rank: int, tp: int, dp_rank: int,
             sharded_dp: bool) -> list[torch.Tensor]:
    """The parts of this copy's gradient counted on this rank, so that the ranks count each element exactly once:
    one stage's copy, one data-parallel replica's (unless sharded), and of its tensor-parallel slice the pieces this
    rank is the first to hold (a piece shared by several TP ranks, k and v rows of a fused q|k|v with fewer kv
    heads than ranks, counted on one; the zero padding on none)."""
    if lp.stage != first_stage or not (sharded_dp or dp_rank == 0):
        return []
    return [view for _, view in rank_chunks(lp.param.grad.detach(), lp.spec, tp_rank, tp, owned=True)]


def clip_grad_norm(params: list[LocalParam], ties: TiedGrads, mesh: DeviceMesh, max_norm: float,
                   norm_type: float, *, sharded_dp: bool) -> torch.Tensor:
    """Scale every gradient so the global norm is at most max_norm; returns the global norm (same on all ranks)."""
    if norm_type not in (2.0, math.inf):
        raise TPCompileError(f"clip_grad_norm_: norm_type {norm_type!r} is not supported; use 2.0 or math.inf")
    coords = {d: mesh[d].get_local_rank() for d in ("tp", "dp")}
    tp = mesh["tp"].size()
    grads = [local_tensor(lp.param.grad) for lp in params if lp.param.grad is not None]
    dtype = grads[0].dtype if grads else torch.float32
    device = grads[0].device if grads else _device(params)
    acc = torch.zeros((), dtype=torch.float64, device=device)
    for lp in params:
        if lp.param.grad is None:
            continue
        for part in _counted(lp, ties.first.get(lp.spec.name, lp.stage), coords["tp"], tp, coords["dp"], sharded_dp):
            if not part.numel():
                continue
            g = part.to(torch.float64)
            acc = torch.maximum(acc, g.abs().max()) if norm_type == math.inf else acc + g.pow(2).sum()
    op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
    for dim in ("tp", "dp", "pp"):
        if mesh[dim].size() > 1:
            dist.all_reduce(acc, op=op, group=mesh[dim].get_group())
    total = (acc if norm_type == math.inf else acc.sqrt()).to(dtype)
    coef = (max_norm / (total.to(torch.float64) + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total


def _device(params: list[LocalParam]) -> Optional[torch.device]:
    """The device of the first parameter (the CPU without any)."""
    return local_tensor(params[0].param).device if params else torch.device("cpu")
