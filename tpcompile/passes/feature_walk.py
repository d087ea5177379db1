"""Ops a projection's features pass through unchanged, channels first: what annotate's searches for the sizes a
fused projection's output is split into (passes/annotate.py, `_segment_parts`) and for its head size may walk past."""
from __future__ import annotations

import operator
from typing import Any, Callable, Optional

import torch
from torch.fx import Node

from tpcompile.passes.head_parts import split_along
from tpcompile.sharding_rules import lookup
from tpcompile.sharding_rules.rule_context import sizes_equal, to_size

POINTWISE = ("pointwise", "pointwise_inplace")  # elementwise op table rows, in place or not


def keeps_features(nxt: Node, cur: Node, fdim: int) -> bool:
    """True when `nxt` keeps the features of `cur` at dim `fdim`, each where it was: an elementwise op, a slice or a
    padding of another dim, or a depthwise convolution over them as channels (the short convolution of linear
    attention), a cat or an index_add along another dim (the experts' outputs, each a linear of its tokens, joined by
    token and put back in order)."""
    a, b = cur.meta.get("val"), nxt.meta.get("val")
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.dim() != b.dim() \
            or not sizes_equal(to_size(a.shape[fdim]), to_size(b.shape[fdim])):
        return False  # (compared as expressions: comparing symbolic sizes would fix the model's inputs)
    if nxt.target is torch.ops.aten.cat.default:  # joined along another dim
        return cur in nxt.args[0] and (nxt.args[1] if len(nxt.args) > 1 else nxt.kwargs.get("dim", 0)) % a.dim() != fdim
    if nxt.target is torch.ops.aten.index_add.default:  # rows added at indices (the experts' outputs put back)
        return cur in (nxt.args[0], nxt.args[3]) and nxt.args[1] % a.dim() != fdim
    if nxt.args[0] is not cur:
        return False
    spec = lookup(nxt.target)
    if spec is not None and spec.rule in POINTWISE:
        return True
    if nxt.target is torch.ops.aten.slice.Tensor:
        return (nxt.args[1] if len(nxt.args) > 1 else 0) % a.dim() != fdim
    if nxt.target in (torch.ops.aten.pad.default, torch.ops.aten.constant_pad_nd.default):
        return True  # padding other dims (a causal convolution's tokens): the features' size is unchanged
    if spec is None or spec.rule != "weight_conv" or fdim != 1:
        return False
    i = spec.get("groups_arg")
    return (nxt.args[i] if i < len(nxt.args) else 1) == a.shape[1]


def nested(sizes: tuple, parts: list[Optional[Node]], fdim: int, walk: Callable[..., Any]) -> tuple[tuple, list]:
    """The sizes a projection's output is split into, each part split again further on replaced by its own parts
    (Mamba-2's x|B|C, one part of z|xBC|dt, split after the depthwise convolution over it)."""
    out_sizes: list = []
    out_parts: list[Optional[Node]] = []
    for size, part in zip(sizes, parts):
        sub = walk(part, size, fdim, True) if part is not None else None
        if sub and sum(sub[0]) == size:
            out_sizes += sub[0]
            out_parts += sub[1]
        else:
            out_sizes.append(size)
            out_parts.append(part)
    return tuple(out_sizes), out_parts


def moved_dim(u: Node, d: int) -> Optional[int]:
    """Where dim d of u's input lands in u's output, for a transpose, permute, unsqueeze or squeeze; else None."""
    if u.target is torch.ops.aten.permute.default:
        return [x % len(u.args[1]) for x in u.args[1]].index(d)
    if u.target is torch.ops.aten.transpose.int:
        nd = u.args[0].meta["val"].dim()
        a, b = u.args[1] % nd, u.args[2] % nd
        return b if d == a else a if d == b else d
    if u.target is torch.ops.aten.unsqueeze.default:
        return d + (u.args[1] % u.meta["val"].dim() <= d)
    if u.target is torch.ops.aten.squeeze.dim:
        at = u.args[1] % u.args[0].meta["val"].dim()
        return None if at == d else d - (at < d)  # (a dim of size 1 squeezed away is gone)
    return None


def heads_through(value: Node, width: int, limit: int = 24, fdim: Optional[int] = None) -> Optional[int]:
    """d where `value`'s `width` features, followed as a run [offset, offset + width) of a feature dim, are cut into
    heads of d by a reshape of that dim to (.., h, d, ..): through elementwise ops, transposes, a depthwise
    convolution, a cat with other features along that dim (q|k|v concatenated before linear attention's short
    convolution) and the part of a split holding the run; or folded into rows, (.., h * d) -> (rows * h, d) (a
    gate of heads normalised per head); or s for a slice taking every s-th of them (interleaved gate|up pairs);
    for pairs viewed as (.., F / s, s, ..) whose members are then cut apart and cut into heads of d each, s x d
    (Zamba's hidden | gate pairs, the hidden cut into Mamba heads). None when no such op is found. `fdim`: the
    feature dim of `value` (else its last dim of size `width`)."""
    val = value.meta.get("val")
    if not isinstance(val, torch.Tensor) or not val.dim():
        return None
    dims = [fdim] if fdim is not None else [d for d in range(val.dim()) if _known(val.shape[d]) == width]
    todo, seen = [(value, dims[-1], 0)] if dims else [], set()
    while todo and len(seen) < limit:
        cur, fdim, offset = todo.pop(0)
        for u in cur.users:
            if u in seen or u.op != "call_function":
                continue
            seen.add(u)
            step = _feature_step(u, cur, fdim, offset, width)
            if isinstance(step, int):
                return step
            todo += [step] if step else []
    return None


def _feature_step(u: Node, cur: Node, fdim: int, offset: int, width: int) -> Any:
    """Where `cur`'s run of features at dim `fdim` is in `u`'s output, (u, dim, offset); its head size when `u` cuts
    the run into heads; None when `u` does not carry it."""
    a, b = cur.meta.get("val"), u.meta.get("val")
    spec = lookup(u.target)
    rule = spec.rule if spec is not None else None
    if u.target is operator.getitem:
        return None
    if u.args[0] is cur and split_along(u, fdim, a.dim()):
        start = 0
        for i, part in enumerate(b):
            size = _known(part.shape[fdim])
            if size is None:
                return None
            if start <= offset and offset + width <= start + size:
                got = [g for g in u.users if g.target is operator.getitem and g.args[1] == i]
                return (got[0], fdim, offset - start) if got else None
            start += size
        return None
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return None
    if rule == "cat" and (u.args[1] if len(u.args) > 1 else 0) % a.dim() == fdim and list(u.args[0]).count(cur) == 1:
        before = [_known(x.meta["val"].shape[fdim]) for x in u.args[0][:list(u.args[0]).index(cur)]]
        return (u, fdim, offset + sum(before)) if None not in before else None
    args = list(u.args) + [None] * (5 - len(u.args))
    if u.target is torch.ops.aten.slice.Tensor and args[1] % a.dim() == fdim and isinstance(args[4], int) \
            and args[4] > 1 and width % args[4] == 0 and offset == 0 and _known(a.shape[fdim]) == width:
        return args[4]  # every s-th feature (gate|up interleaved, `[..., ::2]` and `[..., 1::2]`): units of s
    moved = moved_dim(u, fdim)
    if moved is not None and u.target in (torch.ops.aten.transpose.int, torch.ops.aten.permute.default,
                                          torch.ops.aten.squeeze.dim, torch.ops.aten.unsqueeze.default):
        return u, moved, offset
    same = list(map(str, b.shape[:fdim])) == list(map(str, a.shape[:fdim]))  # symbolic sizes compared as written
    if rule == "reshape" and b.dim() == a.dim() + 1 and same and None not in (_known(b.shape[fdim]), _known(
            b.shape[fdim + 1])) and b.shape[fdim] * b.shape[fdim + 1] == _known(a.shape[fdim]):
        d = int(b.shape[fdim + 1])  # (.., F, ..) -> (.., h, d, ..): the run is whole heads of d
        if offset % d or width % d or d >= width:
            return None
        member = _member_heads(u, fdim, d) if offset == 0 and _known(a.shape[fdim]) == width else None
        return d * member if member and (width // d) % member == 0 else d
    if rule == "reshape" and b.dim() and fdim == a.dim() - 1 and _known(b.shape[-1]) == _known(a.shape[fdim]) \
            is not None:
        return u, b.dim() - 1, offset  # the other dims regrouped, the features last as they were
    if rule == "reshape" and b.dim() and fdim == a.dim() - 1 and b.dim() <= a.dim() and _known(b.shape[-1]) \
            and _known(a.shape[fdim]) == width:  # (.., h * d) -> (rows * h, d): heads folded into the rows
        d = int(b.shape[-1])
        return d if width % d == 0 and d < width and offset == 0 else None
    size = _known(a.shape[fdim])
    if keeps_features(u, cur, fdim) or rule in POINTWISE and b.dim() == a.dim() and size is not None \
            and _known(b.shape[fdim]) == size:
        return u, fdim, offset
    return None


def channel_heads(conv: Node, spec: Any) -> Optional[int]:
    """The head size a depthwise convolution's channels (dim 1) are cut into further on, else None."""
    val, i = conv.meta.get("val"), spec.get("groups_arg")
    groups = conv.args[i] if i is not None and i < len(conv.args) else 1
    if not isinstance(val, torch.Tensor) or val.dim() < 3 or not isinstance(val.shape[1], int) \
            or groups != val.shape[1] or groups < 2:
        return None
    return heads_through(conv, int(val.shape[1]), fdim=1)


def _member_heads(pairs: Node, fdim: int, s: int) -> Optional[int]:
    """d when `pairs` (.., h, s, ..) is split along its dim fdim + 1 into its s members and the first member's h
    features are cut into heads of d further on."""
    val = pairs.meta["val"]
    for u in pairs.users:
        if split_along(u, fdim + 1, val.dim()) and len(u.meta["val"]) == s:
            first = [g for g in u.users if g.target is operator.getitem and g.args[1] == 0]
            return heads_through(first[0], int(val.shape[fdim]), fdim=fdim) if first else None
    return None


def last_dim(node: Node) -> Optional[int]:
    """The size of node's last dim when it is a number."""
    val = node.meta.get("val")
    known = isinstance(val, torch.Tensor) and val.dim() and isinstance(val.shape[-1], int)
    return int(val.shape[-1]) if known else None


def _known(size: Any) -> Optional[int]:
    """A dim's size when it is a number (no guard on a symbolic one)."""
    return int(size) if isinstance(size, int) else None
