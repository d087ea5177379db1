"""Linears that share a replicated input whose gradient is all-reduced, with the all-reduce overlapped:
``torch.ops.tpcompile.linears_grad_all_reduce``.

Forward: `[linear(x, w_i, b_i) for i]`, what the column splits reading `grad_all_reduce(x)` compute.
Backward (Megatron's asynchronous input-gradient all-reduce): the input gradient
`sum_i g_i @ w_i` is computed first and its all-reduce launched; the weight and bias gradients
(`g_i^T x`, `sum g_i`), which need no communication, are computed while it is in flight; then the
sum is waited for. Under torch.distributed the launch is `dist.all_reduce(async_op=True)`; on a
simulated rank the sum runs at once. Only passes/comm_linear_grads.py emits the op.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.library import Library

from tpcompile.ops.collectives import _run
from tpcompile.runtime.backends import Backend, DistBackend
from tpcompile.runtime.failures import collective_error

__all__ = ["linears_grad_all_reduce"]


def split_tensors(tensors: list, has_bias: list) -> tuple:
    """(x, weights, biases) from the op's flat tensor list: x, every weight, then the biases present."""
    n = len(has_bias)
    x, weights, present = tensors[0], list(tensors[1:n + 1]), iter(tensors[n + 1:])
    return x, weights, [next(present) if b else None for b in has_bias]


_lib = Library("tpcompile", "FRAGMENT")
# One flat tensor list (x, weights, biases present), so the schedule record's other arguments are plain values.
_lib.define("linears_grad_all_reduce(Tensor[] tensors, int[] has_bias, str group) -> Tensor[]")


def _linears(tensors: list[torch.Tensor], has_bias: list[int], group: str) -> list[torch.Tensor]:
    """linear(x, w_i, b_i) for each i; in backward, x's gradient is all-reduced while the weights' are computed."""
    x, weights, biases = split_tensors(tensors, has_bias)
    return [F.linear(x, w, b) for w, b in zip(weights, biases)]


def _fake(tensors: list, has_bias: list, group: str) -> list[torch.Tensor]:
    x, weights, _ = split_tensors(tensors, has_bias)
    return [x.new_empty((*x.shape[:-1], w.shape[0])) for w in weights]


def _launch(backend: Backend, gi: torch.Tensor, works: list) -> torch.Tensor:
    """Start summing gi in place: asynchronously under torch.distributed, at once on a simulated rank."""
    if isinstance(backend, DistBackend) and gi.is_contiguous():
        try:
            works.append((dist.all_reduce(gi, group=backend.pg, async_op=True), backend.pg))
        except RuntimeError as e:  # a peer already gone
            raise collective_error(e, "all_reduce of the input gradient", gi, backend.pg) from e
        return gi
    return gi.copy_(backend.all_reduce(gi.clone()))


def _backward(ctx: Any, *grads: Optional[torch.Tensor]) -> tuple:
    x, *weights = ctx.saved_tensors
    live = [(g, w) for g, w in zip(grads, weights) if g is not None]
    gi = None
    for g, w in live:  # the input gradient first: it is what the all-reduce needs
        part = g.matmul(w.to(g.dtype)).to(x.dtype)  # under autocast g is in the low precision, as linear's
        gi = part if gi is None else gi + part
    gi = x.new_zeros(x.shape) if gi is None else gi.contiguous()
    works: list = []
    _run("all_reduce", gi, ctx.group, lambda b: _launch(b, gi, works))
    x2 = x.reshape(-1, x.shape[-1])
    gws, gbs = [], []
    for g, w, has_bias in zip(grads, weights, ctx.has_bias):  # meanwhile: the weights' gradients
        if g is None:
            gws.append(torch.zeros_like(w))
            gbs.append(w.new_zeros(w.shape[0]) if has_bias else None)
            continue
        g2 = g.reshape(-1, g.shape[-1])
        gws.append(g2.t().mm(x2.to(g.dtype)).to(w.dtype))
        gbs.append(g2.sum(0).to(w.dtype) if has_bias else None)
    for work, pg in works:
        try:
            work.wait()
        except RuntimeError as e:  # the sum failed in flight: a dead or stalled peer
            raise collective_error(e, "all_reduce of the input gradient", gi, pg) from e
    return None, None, gi, *gws, *(b for b in gbs if b is not None)


class _LinearsGradAllReduce(torch.autograd.Function):
    """The op's autograd rule: the linears below autograd; backward as described above."""

    @staticmethod
    def forward(ctx: Any, has_bias: list, group: str, *tensors: torch.Tensor) -> tuple:
        ctx.has_bias, ctx.group = has_bias, group
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: its matmuls are skipped
        x, weights, _ = split_tensors(list(tensors), has_bias)
        ctx.save_for_backward(x, *weights)
        with torch._C._AutoDispatchBelowAutograd():
            return tuple(linears_grad_all_reduce(list(tensors), has_bias, group))

    backward = staticmethod(_backward)


def _autograd(tensors: list[torch.Tensor], has_bias: list[int], group: str) -> list[torch.Tensor]:
    """Record the backward only when a gradient is wanted: inference runs the linears and nothing else."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return list(_LinearsGradAllReduce.apply(list(has_bias), group, *tensors))
    with torch._C._AutoDispatchBelowAutograd():
        return linears_grad_all_reduce(tensors, has_bias, group)


_lib.impl("linears_grad_all_reduce", _linears, "CompositeExplicitAutograd")
_lib.impl("linears_grad_all_reduce", _autograd, "Autograd")
torch.library.register_fake("tpcompile::linears_grad_all_reduce", _fake, lib=_lib)
linears_grad_all_reduce = torch.ops.tpcompile.linears_grad_all_reduce.default
