"""Zero-padded splits through reshapes: a projection padded by whole heads, viewed as (heads, head_dim) and back.

A column split whose output size the world size does not divide is zero-padded to a multiple of it
(`Shard(dim, cuts=pad_cuts(N, ws))`, whose `padded` is N); when a reshape splits that output into heads, the
padding goes by whole heads (sharding_rules/matmul.py), so the heads dim carries the padding and each rank holds
whole heads.
"""
from __future__ import annotations

import operator

from dataclasses import replace
from typing import Any, Optional, Sequence

import sympy
import torch
from torch.fx import Node

from tpcompile.layouts import dim_layout
from tpcompile.placement import REPLICATE, Shard, cut_shard, pad_cuts, seg_cuts
from tpcompile.sharding_rules.grouped import on_one
from tpcompile.sharding_rules.padding_values import MULTILINEAR, NORMS, SPLITS, cut_whole, finite_padding
from tpcompile.sharding_rules.rule_context import Result, Size, Want, exact_size, prod, sizes_equal


def padded_reshape(p: Shard, gi: Sequence[int], gj: Sequence[int], ins: Sequence[Size], outs: Sequence[Size],
                   ws: int) -> tuple[Optional[Shard], str]:
    """A zero-padded split through a reshape: (heads * d) padded by whole heads <-> (heads, d), and back.

    The padded dim must lead its group of dims (nothing folded before it), and each rank's block of the padded
    elements must hold whole entries of the output dim that carries it: that dim is then padded the same way.
    """
    why = f"reshape of a dim padded from {ins[p.dim]} to {p.padding} cuts through the padding"
    if p.seg_padded and not (p.outer or p.pieces or p.split_next or p.seq) and gi[0] == p.dim:
        return _segments_reshape(p, gi, gj, ins, outs, ws, why)
    if p.segments or p.pieces or p.split_next or p.seq:
        return None, why
    if p.outer is not None or gi[0] != p.dim:
        return _folded_reshape(p, gi, gj, ins, outs, why)
    inner = prod([ins[d] for d in gi[1:]])
    real, full = ins[p.dim], p.padded
    if not isinstance(inner, int) or not isinstance(real, int):
        return None, why
    for u, d in enumerate(gj):
        if prod([outs[e] for e in gj[:u]]) != 1 or outs[d] == 1:
            continue
        q = prod([outs[e] for e in gj[u + 1:]])
        if not isinstance(q, int) or (real * inner) % q or (full * inner) % (ws * q):
            return None, why
        return replace(p, dim=d, cuts=pad_cuts(full * inner // q, ws)), ""
    return None, why


def _folded_reshape(p: Shard, gi: Sequence[int], gj: Sequence[int], ins: Sequence[Size], outs: Sequence[Size],
                    why: str) -> tuple[Optional[Shard], str]:
    """Padded heads folded with the dims before them and back: (B, heads, T, d) <-> (B * heads, T, d), as XGLM's
    and BART's attention computes scores. The folded dim is `outer` repetitions of the padded heads; the dims
    after the heads stay as they are, or merge with them when the repetitions unfold into the dims before
    ((B * T * heads, d) -> (B, T, heads * d), the chunked gated delta rule's), padded by whole heads; merged heads
    fold into the rows the same way ((B, T, heads * d) -> (B * T * heads, d), a gate normalised per head)."""
    t = gi.index(p.dim)
    inner = prod([ins[d] for d in gi[t + 1:]])
    real = ins[p.dim] if p.outer is None else exact_size(sympy.sympify(ins[p.dim]) / sympy.sympify(p.outer))
    count = prod([ins[d] for d in gi[:t]]) * (p.outer or 1)
    if real is None or not isinstance(inner, int):
        return None, why
    for u, d in enumerate(gj):
        if not sizes_equal(prod([outs[e] for e in gj[u + 1:]]), inner) or outs[d] == 1:
            continue
        m = exact_size(sympy.sympify(outs[d]) / sympy.sympify(real))  # repetitions folded into this dim
        if m is not None and sizes_equal(prod([outs[e] for e in gj[:u]]) * m, count):
            return Shard(d, outer=None if m == 1 else m, cuts=p.cuts), ""
    for u, d in enumerate(gj):  # the heads' entries split off and the heads folded: (B, T, h*d) -> (B*T*h, d)
        q = prod([outs[e] for e in gj[u + 1:]])
        if p.outer is None and inner == 1 and isinstance(q, int) and q > 1 and isinstance(p.padded, int) \
                and real % q == 0 and p.padded % (q * (len(p.cuts[0]) - 1)) == 0 \
                and prod([outs[e] for e in gj[:u]]) == 1 and sizes_equal(outs[d], count * (real // q)):
            return Shard(d, outer=None if count == 1 else count, cuts=pad_cuts(p.padded // q, len(p.cuts[0]) - 1)), ""
    for u, d in enumerate(gj):  # unfolded, the heads merged with the dims after them: (B*T*h, d) -> (B, T, h*d)
        if prod([outs[e] for e in gj[u + 1:]]) == 1 and sizes_equal(outs[d], real * inner) \
                and sizes_equal(prod([outs[e] for e in gj[:u]]), count) and isinstance(p.padded, int):
            return Shard(d, cuts=pad_cuts(p.padded * inner, len(p.cuts[0]) - 1)), ""
    return None, why


def _segments_reshape(p: Shard, gi: Sequence[int], gj: Sequence[int], ins: Sequence[Size], outs: Sequence[Size],
                      ws: int, why: str) -> tuple[Optional[Shard], str]:
    """Padded segments through a reshape that keeps each segment's entries whole (Falcon's fused q|k|v viewed as
    (heads + 2, head_dim)): the segments and their paddings, in entries of the output dim; equal segments stacked
    as a dim of their own (Moshi's gate and up, (.., 2, F); JetMoE's heads of its top-k experts, (.., k * h, d)
    -> (.., k, h * d)): the last dim, padded as each of them."""
    inner = prod([ins[d] for d in gi[1:]])
    counts, pads = p.counts(ws), p.pads()
    if isinstance(inner, int) and len(gj) > 1 and len(set(p.segments)) == 1 and len(set(pads)) == 1 \
            and set(counts) == {ws} and outs[gj[-1]] == p.segments[0] * inner \
            and prod([outs[e] for e in gj[:-1]]) == len(p.segments):
        # equal segments stacked as a dim of their own, (.., g * s, i) -> (.., g, s * i): each cut as the last dim
        return Shard(gj[-1], cuts=pad_cuts(pads[0] * inner, ws)), ""
    for u, d in enumerate(gj):
        if prod([outs[e] for e in gj[:u]]) != 1 or outs[d] == 1:
            continue
        q = prod([outs[e] for e in gj[u + 1:]])
        sizes = [s * inner for s in p.segments] + [x * inner for x in pads]
        if not isinstance(q, int) or not isinstance(inner, int) or any(v % q for v in sizes) \
                or any((x * inner // q) % g for x, g in zip(pads, counts)):
            return None, why
        segs = tuple(s * inner // q for s in p.segments)
        return replace(p, dim=d, segments=segs, cuts=seg_cuts(segs, ws, [x * inner // q for x in pads], counts)), ""
    return None, why


def split_cut_segments(node: Node, p: Shard, sizes: list[int], ws: int) -> Result:
    """split / chunk of a dim whose segments are cut at their own bounds (each padded: a fused q|k|v by whole
    heads; one piece a rank: a fused q|k|v's kv groups cut among the ranks sharing them): every piece must be
    whole segments, and takes their cuts; its local size, the same on every rank, is what a rank holds of them."""
    x, segs, layout = node.args[0], list(p.segments), dim_layout(p, None, ws)
    extents = [[b - a for a, b in layout.blocks(r)] for r in range(ws)]
    outs, local, k = [], [], 0
    for want in sizes:
        k0 = k
        while k < len(segs) and sum(segs[k0:k]) < want:
            k += 1
        held = {sum(e[k0:k]) for e in extents}
        if sum(segs[k0:k]) != want or len(held) != 1:
            why = f"cuts through the padded segments {tuple(segs)}" if sum(segs[k0:k]) != want else \
                f"gives the ranks different sizes of the segments {tuple(segs)} cut as {p}"
            return Result(tuple(REPLICATE for _ in sizes), [Want(x, REPLICATE)], conflict=f"split into {sizes} {why}")
        outs.append(on_one(cut_shard(p.dim, segs[k0:k], p.cuts[k0:k], ws), node.meta["val"][len(outs)].shape))
        local.append(held.pop())
    by_size = node.target in (torch.ops.aten.chunk.default, torch.ops.aten.split.Tensor)  # one size for all
    if by_size and (len(set(local[:-1])) > 1 or local[-1] > local[0]):  # the last part may only be shorter
        return Result(tuple(REPLICATE for _ in sizes), [Want(x, REPLICATE)],
                      conflict=f"{node.target} of padded segments whose parts differ in size on a rank ({local})")
    loc = None if node.target is torch.ops.aten.chunk.default else [("set", 1, local[0] if by_size else local, None)]
    return Result(tuple(outs), [Want(x, p)], localize=loc)


# ops whose result is zero wherever their padded operands are zero (layouts, casts, f(0) = 0)
_KEEPS_ZERO = frozenset(
    "aten.view.default aten.reshape.default aten._unsafe_view.default aten.transpose.int aten.permute.default "
    "aten.t.default aten.unsqueeze.default aten.squeeze.dim aten.squeeze.default aten.expand.default "
    "aten.flatten.using_ints aten.unflatten.int aten.slice.Tensor aten.select.int aten.contiguous.default "
    "aten.clone.default aten._to_copy.default aten.to.dtype aten.to.dtype_layout aten.to.device aten.to.other "
    "aten.type_as.default "
    "aten.alias.default aten.detach.default aten.neg.default aten.abs.default aten.relu.default aten.silu.default "
    "aten.gelu.default aten.tanh.default aten.sin.default aten.sqrt.default aten.square.default "
    "aten.mul.Scalar aten.div.Scalar aten.dropout.default aten.cat.default aten.add.Tensor aten.sub.Tensor "
    "aten.mul.Tensor aten.div.Tensor aten.pow.Tensor_Scalar aten.stack.default aten.mean.dim "
    "aten.sum.dim_IntList".split())  # a sum or mean kept padded reduced over other dims

_ATTENTION = frozenset(("aten.scaled_dot_product_attention.default",))
_PADS = frozenset(("aten.pad.default", "aten.constant_pad_nd.default"))


def zero_padded(x: Node, placement, depth: int = 24, rule: Any = None) -> bool:
    """True when the padding of `x`'s padded split is known to hold zeros: it comes from weight ops whose padded
    weight rows (and bias) are zeros, through ops that keep zeros (a layout op, a cast, f(0) = 0, a product with a
    factor, a sum of padded values). A sum or mean over the padded dim is then the sum of what the ranks hold.
    `rule` reads a node's op table row (the frozen plan's, after propagation; node.meta's by default)."""
    from tpcompile.sharding_rules.table import op_name

    p = placement(x)
    if not isinstance(p, Shard) or p.padding is None:
        return False
    if depth <= 0 or not isinstance(x, Node):
        return False
    rule = rule or (lambda n: n.meta.get("tp_rule"))
    spec = rule(x)
    if spec is not None and spec.rule == "weight_matmul":
        act = x.args[0] if x.args else None
        if isinstance(act, Node) and isinstance(placement(act), Shard) and placement(act).padding is not None:
            return zero_padded(act, placement, depth - 1, rule) and (len(x.args) < 3 or x.args[2] is None)
        return True
    name = op_name(x.target).replace("_.", ".") if x.op == "call_function" else ""  # in place as out of place
    src = x.args[0] if x.target is operator.getitem and isinstance(x.args[0], Node) else None
    if src is not None and op_name(src.target) in SPLITS and isinstance(src.args[0], Node):  # a part of a split
        return zero_padded(src.args[0], placement, depth - 1, rule)
    if name in _ATTENTION:  # each query's weights sum to one over the keys: zero where the values are zero
        return len(x.args) > 2 and isinstance(x.args[2], Node) and zero_padded(x.args[2], placement, depth - 1, rule) \
            and finite_padding(x, placement, rule)
    if name in NORMS:  # normalised, times the weight's zero padding
        return len(x.args) > 2 and isinstance(x.args[2], Node) and isinstance(placement(x.args[2]), Shard)
    if name in _PADS:  # new entries along other dims of zeros (the mode constant, the value 0)
        if name == "aten.constant_pad_nd.default":
            constant, fill = True, x.args[2] if len(x.args) > 2 else 0
        else:
            constant = (x.args[2] if len(x.args) > 2 else x.kwargs.get("mode", "constant")) == "constant"
            fill = x.args[3] if len(x.args) > 3 else x.kwargs.get("value")
        return constant and not fill and isinstance(x.args[0], Node) \
            and zero_padded(x.args[0], placement, depth - 1, rule)
    if name in MULTILINEAR:  # split, not summed: the padded dim is one the product keeps, zero in one factor
        ins = [a for a in x.all_input_nodes if isinstance(placement(a), Shard) and placement(a).padding is not None]
        return any(zero_padded(a, placement, depth - 1, rule) for a in ins) and finite_padding(x, placement, rule)
    if name not in _KEEPS_ZERO:
        return False
    if name == "aten.pow.Tensor_Scalar" and not (isinstance(x.args[1], (int, float)) and x.args[1] > 0):
        return False
    if name in ("aten.add.Tensor", "aten.sub.Tensor") and not isinstance(x.args[1], Node):
        return False  # x + 1 fills the padding
    tensors = [a for a in x.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
    padded = [a for a in tensors if isinstance(placement(a), Shard) and placement(a).padding is not None]
    if name in ("aten.mul.Tensor",):  # one zero factor makes the product zero (a whole one is cut with zeros), the
        # others finite there (0 x inf is nan)
        return (any(cut_whole(a, x, placement) for a in tensors if a not in padded)
                or any(zero_padded(a, placement, depth - 1, rule) for a in padded)) \
            and finite_padding(x, placement, rule)
    if name == "aten.div.Tensor":  # zeros over a divisor that is not padded (not 0 / 0)
        num, den = x.args[0], x.args[1]
        return num in padded and den not in padded and zero_padded(num, placement, depth - 1, rule)
    # every tensor operand padded alike and zero there, or whole and cut to the split (rewrite_slices.local_slice
    # zero-pads it); a whole operand broadcast along the padded dim would fill the padding
    return bool(padded) and all(cut_whole(a, x, placement) for a in tensors if a not in padded) \
        and all(zero_padded(a, placement, depth - 1, rule) for a in padded)
