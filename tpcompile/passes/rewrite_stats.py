"""Rewrites of reductions and normalisations over a split dim (role 'stats'): local partial statistics and one
small collective, combined exactly on every rank (sharding_rules/reductions.py chooses them).

- sum / mean: the op on the local slice, all-reduced (a mean divided by the world size: equal slices; over a
  zero-padded split or each rank's own cut of segments (a kv group's heads), scaled by the local size over the
  real one; over tokens whose shares may differ, the sums
  summed and divided by the count).
- max / min / log-sum-exp / vector norm: the op on the local slice, every rank's result gathered
  (`all_gather_replicated`, a new leading dim) and reduced again over the ranks (over a zero-padded split, the
  padding filled first with what never wins: -inf for a max or a log-sum-exp).
- var / std: each rank's mean and sum of squared deviations, gathered and merged (Chan et al.).
- LayerNorm, RMSNorm, softmax, log_softmax: two values per row (RMSNorm one) gathered with
  `all_gather`, whose backward reduce-scatters the partial gradients of the statistics; each rank
  normalises its own slice (a LayerNorm over a zero-padded split: the mean, squared deviations and count of the
  rank's real entries, merged). Statistics are computed in float32 (float64 for float64 inputs), as
  the fused kernels do, and the result is cast to the op's dtype.
"""
from __future__ import annotations

from typing import Any, Callable

import sympy
import torch
from torch.fx import Node

from tpcompile.layouts import dim_layout
from tpcompile.passes.rewrite_sizes import size_node
from tpcompile.passes.rewrite_slices import zero_padding
from tpcompile.placement import is_seq, local_shape, shape_key
from tpcompile.sharding_rules.rule_context import to_size
from tpcompile.sharding_rules.reductions import even_pieces, keepdim, reduced_dims

aten = torch.ops.aten
tp = torch.ops.tpcompile
Lookup = Callable[[Node], Node]


def is_stats(node: Node, plan: Any) -> bool:
    """A node whose rule chose partial statistics (in the frozen plan `plan`)."""
    return plan.layout(node).role == "stats"


class _Ops:
    """Emits aten calls and collectives into the rank graph being built."""

    def __init__(self, em: Any, node: Node) -> None:
        self.em, self.node = em, node
        self.x = node.args[0]
        self.p = em.plan.placement(self.x)
        val = self.x.meta["val"]
        self.local = list(local_shape(val.shape, self.p, em.rank, em.ws))
        self.work = torch.float64 if val.dtype == torch.float64 else torch.float32
        self.ws, self.group = em.ws, em.plan.group

    def call(self, op: Any, *args: Any, **kw: Any) -> Node:
        return self.em.call(op, *args, **kw)

    def up(self, t: Node, dtype: torch.dtype) -> Node:
        """t in the working precision (it holds dtype now)."""
        return t if dtype == self.work else self.call(aten._to_copy.default, t, dtype=self.work)

    def cast(self, t: Node) -> Node:
        """t in the op's own output dtype."""
        val = self.node.meta["val"]
        return t if val.dtype == self.work else self.call(aten._to_copy.default, t, dtype=val.dtype)

    def gather(self, op: Any, t: Node, dim: int, shape: list) -> Node:
        """A collective on t (shape `shape` on this rank), its shape recorded for the schedule check."""
        out = self.call(op, t, dim, self.group)
        out.meta["tp_shape"] = shape_key(shape)
        return out


def emit_stats(em: Any, node: Node, lookup: Lookup) -> Node:
    """The rank-local replacement of a reduction or normalisation over the split dim."""
    rule = em.plan.rule(node).rule
    return {"reduce": _reduce, "norm": _norm, "softmax": _softmax}[rule](_Ops(em, node), node, lookup)


def _reduce(o: _Ops, node: Node, lookup: Lookup) -> Node:
    spec = o.em.plan.rule(node)
    combine = spec.get("combine")
    if combine in ("var", "std"):
        return _variance(o, node, lookup, combine)
    padded = o.p.padding is not None or o.p.rank_cuts  # zero-padded, or each rank's own cut (zeros past it)
    if combine in ("sum", "mean") and padded:  # zeros that pass no gradient to the padding
        zeroed, inner = zero_padding(o.em, o.x, lookup(o.x), proven=False), lookup

        def lookup(n: Node) -> Node:
            return zeroed if n is o.x else inner(n)
    if combine == "mean" and is_seq(o.p) and not _even_tokens(o):
        return _token_mean(o, node, lookup)
    if combine in ("max", "min") and is_seq(o.p) and not _even_tokens(o):  # a rank may hold no token: one more
        fill = _never_wins(o.x.meta["val"].dtype, combine)  # entry that never wins makes its slice non-empty
        pad = [0, 0] * (o.x.meta["val"].dim() - 1 - o.p.dim) + [0, 1]
        padded, inner = o.call(aten.constant_pad_nd.default, lookup(o.x), pad, fill), lookup

        def lookup(n: Node) -> Node:
            return padded if n is o.x else inner(n)
    if combine in ("max", "min", "logsumexp") and o.p.plain_padded:  # the padding filled with what never wins
        fill = _never_wins(o.x.meta["val"].dtype, "max" if combine == "logsumexp" else combine)
        filled, inner = _fill_padding(o, lookup(o.x), fill), lookup

        def lookup(n: Node) -> Node:
            return filled if n is o.x else inner(n)
    local = o.em.copy(node, lookup)  # the op itself on this rank's slice
    local.meta.pop("val", None)
    if combine in ("sum", "mean"):
        out = o.call(tp.all_reduce.default, local, o.group)
        if combine == "mean" and padded:  # local means over padded slices: scale to the real size
            return o.call(aten.mul.Scalar, out, o.local[o.p.dim] / int(o.x.meta["val"].shape[o.p.dim]))
        if combine == "sum" and even_pieces(o.p, o.ws):  # each piece summed by every rank sharing it
            return o.call(aten.div.Scalar, out, o.ws // o.p.pieces)
        return o.call(aten.div.Scalar, out, o.ws) if combine == "mean" else out  # (in pieces too: ws x the mean)
    shape = [1, *node.meta["val"].shape]
    ranks = o.gather(tp.all_gather_replicated.default, o.call(aten.unsqueeze.default, local, 0), 0, shape)
    if combine == "max":
        return o.call(aten.amax.default, ranks, [0])
    if combine == "min":
        return o.call(aten.amin.default, ranks, [0])
    if combine == "logsumexp":
        return o.call(aten.logsumexp.default, ranks, [0])
    order = node.args[1] if len(node.args) > 1 else node.kwargs.get("ord", 2)
    return o.call(aten.linalg_vector_norm.default, ranks, order, [0])  # the norm of the ranks' norms


def _fill_padding(o: _Ops, x: Node, fill: float) -> Node:
    """x, this rank's block of a zero-padded split, with its padding (the block past its real entries) set to
    `fill`: its real entries, then constants, which pass no gradient back."""
    _, at, real, block = dim_layout(o.p, int(o.x.meta["val"].shape[o.p.dim]), o.ws).runs(o.em.rank)[0]
    if real == block:
        return x
    pad = [0, 0] * (o.x.meta["val"].dim() - 1 - o.p.dim) + [0, block - real]
    return o.call(aten.constant_pad_nd.default, o.call(aten.narrow.default, x, o.p.dim, at, real), pad, fill)


def _even_tokens(o: _Ops) -> bool:
    """True for a token split of a fixed length the world size divides: equal shares."""
    size = o.x.meta["val"].shape[o.p.dim]
    return isinstance(size, int) and o.p.outer is None and size % o.ws == 0


def _token_mean(o: _Ops, node: Node, lookup: Lookup) -> Node:
    """A mean over tokens whose ranks' shares may differ by one (layouts/token_shares.py): the ranks' sums, summed,
    over the count of the entries reduced (a run-time size of the model's inputs)."""
    x, val, spec = lookup(o.x), o.x.meta["val"], o.em.plan.rule(node)
    dims = reduced_dims(node, spec, val.dim())
    dtype = {"dtype": node.kwargs["dtype"]} if node.kwargs.get("dtype") is not None else {}
    local = o.call(aten.sum.dim_IntList, x, dims, keepdim(node, spec), **dtype)
    count = size_node(o.em, sympy.Mul(*[sympy.sympify(to_size(val.shape[d])) for d in dims]))
    return o.call(aten.div.Tensor, o.call(tp.all_reduce.default, local, o.group), count)


def _never_wins(dtype: torch.dtype, combine: str) -> float:
    """The value a max (min) of `dtype` values never takes over a real one."""
    info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
    low, high = (-float("inf"), float("inf")) if dtype.is_floating_point else (info.min, info.max)
    return low if combine == "max" else high


def _correction(node: Node) -> float:
    if "correction" in node.kwargs:
        c = node.kwargs["correction"]
        return 1.0 if c is None else float(c)
    if "dim" in str(node.target).rpartition(".")[2]:  # var.dim / std.dim: (x, dim, unbiased, keepdim)
        return 1.0 if (node.args[2] if len(node.args) > 2 else True) else 0.0
    return 1.0


def _variance(o: _Ops, node: Node, lookup: Lookup, combine: str) -> Node:
    """Chan et al.'s merge of per-rank (mean, sum of squared deviations) over the split dim."""
    d, total = o.p.dim, int(o.x.meta["val"].shape[o.p.dim])
    n = total // o.ws
    x = o.up(lookup(o.x), o.x.meta["val"].dtype)
    if o.p.padding is not None:  # zero-padded last dim: the real entries' moments, merged with their counts
        var = _padded_moments(o, x, total, tp.all_gather_replicated.default)[1]
        return _finish(o, node, o.call(aten.mul.Scalar, var, total / max(total - _correction(node), 0.0)), combine)
    mean = o.call(aten.mean.dim, x, [d], True)
    m2 = o.call(aten.sum.dim_IntList, o.call(aten.pow.Tensor_Scalar, o.call(aten.sub.Tensor, x, mean), 2), [d], True)
    stats = o.call(aten.unsqueeze.default, o.call(aten.stack.default, [mean, m2]), 0)  # (1, 2, ..., 1, ...)
    shape = [1, 2, *o.local[:d], 1, *o.local[d + 1:]]
    ranks = o.gather(tp.all_gather_replicated.default, stats, 0, shape)  # (ws, 2, ...)
    means, m2s = o.call(aten.select.int, ranks, 1, 0), o.call(aten.select.int, ranks, 1, 1)
    mu = o.call(aten.mean.dim, means, [0])
    spread = o.call(aten.sum.dim_IntList, o.call(aten.pow.Tensor_Scalar, o.call(aten.sub.Tensor, means, mu), 2), [0])
    m2 = o.call(aten.add.Tensor, o.call(aten.sum.dim_IntList, m2s, [0]), o.call(aten.mul.Scalar, spread, n))
    return _finish(o, node, o.call(aten.div.Scalar, m2, max(total - _correction(node), 0.0)), combine)


def _finish(o: _Ops, node: Node, var: Node, combine: str) -> Node:
    """The variance (over the split dim, kept) as the op gives it: its square root for std, the dim dropped unless
    kept, in the op's dtype."""
    out = o.call(aten.sqrt.default, var) if combine == "std" else var
    if not keepdim(node, o.em.plan.rule(node)):
        out = o.call(aten.squeeze.dim, out, o.p.dim)
    return o.cast(out)


def _norm(o: _Ops, node: Node, lookup: Lookup) -> Node:
    """LayerNorm / RMSNorm over the split last dim: each rank normalises its slice with the gathered statistics."""
    rms = node.target is aten.rms_norm.default
    total = int(o.x.meta["val"].shape[-1])
    x = o.up(lookup(o.x), o.x.meta["val"].dtype)
    weight = node.args[2] if len(node.args) > 2 else None
    bias = None if rms or len(node.args) <= 3 else node.args[3]
    eps = (node.args[3] if len(node.args) > 3 else None) if rms else (node.args[4] if len(node.args) > 4 else 1e-5)
    if eps is None:
        eps = torch.finfo(o.work).eps  # rms_norm's default: the epsilon of its working precision
    if rms:
        sq = o.call(aten.sum.dim_IntList, o.call(aten.pow.Tensor_Scalar, x, 2), [-1], True)
        ranks = o.gather(tp.all_gather.default, sq, -1, [*o.local[:-1], 1])  # (..., ws)
        ms = o.call(aten.div.Scalar, o.call(aten.sum.dim_IntList, ranks, [-1], True), total)
        y = o.call(aten.mul.Tensor, x, o.call(aten.rsqrt.default, o.call(aten.add.Scalar, ms, eps)))
    elif o.p.padding is not None:  # zero-padded: Chan's merge over each rank's count of real entries
        mu, var = _padded_moments(o, x, total)
        y = o.call(aten.mul.Tensor, o.call(aten.sub.Tensor, x, mu),
                   o.call(aten.rsqrt.default, o.call(aten.add.Scalar, var, eps)))
    else:
        mean = o.call(aten.mean.dim, x, [-1], True)
        m2 = o.call(aten.sum.dim_IntList, o.call(aten.pow.Tensor_Scalar, o.call(aten.sub.Tensor, x, mean), 2),
                    [-1], True)
        stats = o.call(aten.cat.default, [mean, m2], -1)  # (..., 2)
        ranks = o.gather(tp.all_gather.default, stats, -1, [*o.local[:-1], 2])  # (..., 2 * ws)
        ranks = o.call(aten.unflatten.int, ranks, -1, [o.ws, 2])
        means, m2s = o.call(aten.select.int, ranks, -1, 0), o.call(aten.select.int, ranks, -1, 1)
        mu = o.call(aten.mean.dim, means, [-1], True)
        spread = o.call(aten.sum.dim_IntList,
                        o.call(aten.pow.Tensor_Scalar, o.call(aten.sub.Tensor, means, mu), 2), [-1], True)
        var = o.call(aten.add.Tensor, o.call(aten.sum.dim_IntList, m2s, [-1], True),
                     o.call(aten.mul.Scalar, spread, total // o.ws))
        var = o.call(aten.div.Scalar, var, total)
        y = o.call(aten.mul.Tensor, o.call(aten.sub.Tensor, x, mu),
                   o.call(aten.rsqrt.default, o.call(aten.add.Scalar, var, eps)))
    if isinstance(weight, Node):
        y = o.call(aten.mul.Tensor, y, lookup(weight))
    if isinstance(bias, Node):
        y = o.call(aten.add.Tensor, y, lookup(bias))
    return o.cast(y)


def _padded_moments(o: _Ops, x: Node, total: int, gather: Any = tp.all_gather.default) -> tuple[Node, Node]:
    """Mean and (biased) variance over the zero-padded last dim of x: each rank's mean, sum of squared deviations and
    count over its real entries (the layout's runs, padding left out), gathered and merged (Chan et al.; not from
    sums of x and x^2, which cancel when the mean is far from zero). `gather`: all_gather for statistics a split
    value is normalised with (their gradients summed over the ranks), all_gather_replicated for a whole result."""
    runs = [(at, n) for _, at, n, _ in dim_layout(o.p, total, o.ws).runs(o.em.rank) if n]
    real = [o.call(aten.narrow.default, x, -1, at, n) for at, n in runs]
    if not real:  # a rank past the last entry: no mean, no deviations
        mean = m2 = o.call(aten.mul.Scalar, o.call(aten.sum.dim_IntList, x, [-1], True), 0.0)
    else:
        xr = real[0] if len(real) == 1 else o.call(aten.cat.default, real, -1)
        mean = o.call(aten.mean.dim, xr, [-1], True)
        m2 = o.call(aten.sum.dim_IntList, o.call(aten.pow.Tensor_Scalar, o.call(aten.sub.Tensor, xr, mean), 2),
                    [-1], True)
    count = o.call(aten.full_like.default, mean, float(sum(n for _, n in runs)))
    ranks = o.gather(gather, o.call(aten.cat.default, [mean, m2, count], -1), -1, [*o.local[:-1], 3])
    ranks = o.call(aten.unflatten.int, ranks, -1, [o.ws, 3])  # (..., ws, 3)
    means, m2s, counts = (o.call(aten.select.int, ranks, -1, i) for i in range(3))
    mu = o.call(aten.div.Scalar, o.call(aten.sum.dim_IntList, o.call(aten.mul.Tensor, means, counts), [-1], True), total)
    spread = o.call(aten.mul.Tensor, counts, o.call(aten.pow.Tensor_Scalar, o.call(aten.sub.Tensor, means, mu), 2))
    m2 = o.call(aten.add.Tensor, o.call(aten.sum.dim_IntList, m2s, [-1], True),
                o.call(aten.sum.dim_IntList, spread, [-1], True))
    return mu, o.call(aten.div.Scalar, m2, total)


def _softmax(o: _Ops, node: Node, lookup: Lookup) -> Node:
    """softmax / log_softmax along the split dim from every rank's (max, sum of exponentials)."""
    d = o.p.dim
    x = o.up(lookup(o.x), o.x.meta["val"].dtype)
    neg_inf = float("-inf")
    m = o.call(aten.amax.default, x, [d], True)  # -inf where this rank's slice is all masked
    safe = o.call(aten.masked_fill.Scalar, m, o.call(aten.eq.Scalar, m, neg_inf), 0.0)
    s = o.call(aten.sum.dim_IntList, o.call(aten.exp.default, o.call(aten.sub.Tensor, x, safe)), [d], True)
    stats = o.call(aten.cat.default, [m, s], d)
    ranks = o.gather(tp.all_gather.default, stats, d, [*o.local[:d], 2, *o.local[d + 1:]])
    ranks = o.call(aten.unflatten.int, ranks, d, [o.ws, 2])
    ms, ss = o.call(aten.select.int, ranks, d + 1, 0), o.call(aten.select.int, ranks, d + 1, 1)
    top = o.call(aten.amax.default, ms, [d], True)
    top = o.call(aten.masked_fill.Scalar, top, o.call(aten.eq.Scalar, top, neg_inf), 0.0)
    scale = o.call(aten.exp.default, o.call(aten.sub.Tensor, ms, top))
    total = o.call(aten.sum.dim_IntList, o.call(aten.mul.Tensor, ss, scale), [d], True)
    shifted = o.call(aten.sub.Tensor, x, top)
    if "log_softmax" in str(node.target):
        y = o.call(aten.sub.Tensor, shifted, o.call(aten.log.default, total))
    else:
        y = o.call(aten.div.Tensor, o.call(aten.exp.default, shifted), total)
    return o.cast(y)
