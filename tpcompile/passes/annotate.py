"""Annotate pass: look up each op's sharding rule and find fused projections' segments."""
from __future__ import annotations

import operator
from typing import Optional

import torch
from torch.fx import GraphModule, Node

from tpcompile.passes.feature_walk import (POINTWISE, channel_heads, heads_through, keeps_features,
                                          last_dim as _last_dim, moved_dim as _moved_dim, nested)
from tpcompile.passes.head_groups import mark_head_groups
from tpcompile.passes.head_runs import align_head_runs
from tpcompile.passes.head_parts import head_parts, split_along
from tpcompile.passes.head_repeats import mark_head_repeats
from tpcompile.passes.param_pieces import mark_pieces
from tpcompile.passes.pass_context import PassContext, module_path, owner_path
from tpcompile.passes.size_equalities import record_size_equalities
from tpcompile.passes.weight_roles import mark_kept_whole
from tpcompile.sharding_rules import RuleSpec, lookup
from tpcompile.sharding_rules.contract_readers import index_needs
from tpcompile.sharding_rules.experts import contraction
from tpcompile.sharding_rules.rule_context import param_behind, weight_view

_SPLITS = {"split", "unbind"}
_FOLLOW = {*POINTWISE, "reshape"}
_ASIDE = (torch.ops.aten.sym_size.int, torch.ops.aten._assert_tensor_metadata.default)


def annotate_pass(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Write node.meta['tp_rule'] (the op table row, None when the op has none) on every op."""
    record_size_equalities(gm)  # input sizes a view proves equal (cross-attention's two batches), before any rule
    ctx.tensors = dict(gm.named_parameters(remove_duplicate=False))
    ctx.tensors.update(dict(gm.named_buffers(remove_duplicate=False)))
    for node in gm.graph.nodes:  # first the picks by constant positions: fused projections are cut by them
        spec = lookup(node.target) if node.op == "call_function" else None
        if spec is not None and spec.rule == "index":
            positions = _constant_positions(gm, node)
            node.meta["tp_rule"] = RuleSpec(spec.rule, {**spec.args, "positions": positions}) if positions else spec
    for node in (n for n in gm.graph.nodes if n.op == "call_function"):
        spec = lookup(node.target)
        if spec is not None and spec.rule == "index":
            continue
        if spec is not None and spec.rule == "weight_matmul":
            segments, parts = _segment_parts(node) or (None, [node])
            heads = _heads(parts, segments or (_last_dim(node),))
            if segments or heads:
                spec = RuleSpec(spec.rule, {**spec.args, "segments": segments, "heads": heads})
        head = channel_heads(node, spec) if spec is not None and spec.rule == "weight_conv" else None
        if head:
            spec = RuleSpec(spec.rule, {**spec.args, "heads": (head,)})
        if spec is not None and spec.rule in ("weight_matmul", "weight_conv", "embedding"):
            spec = RuleSpec(spec.rule, {**spec.args, "owner": _owner(node, spec, ctx)})
        node.meta["tp_rule"] = _contraction(node, ctx) or spec
    mark_pieces(gm, ctx)  # linears reading row pieces of a parameter: each piece a weight of its own
    mark_kept_whole(gm, ctx)
    align_head_runs(gm, ctx)  # projections an attention reads cut into the same runs of heads
    mark_head_groups(gm, ctx)  # grouped-query attention best split by whole groups of query heads
    mark_head_repeats(gm, ctx)  # heads repeated for other heads (linear attention), fewer than the ranks
    return gm


def _contraction(node: Node, ctx: PassContext) -> Optional[RuleSpec]:
    """weight_contract for a matmul / einsum / grouped matmul with a 3-D (expert) or gathered parameter view,
    or an einsum with a parameter no other op reads (sharding_rules/experts.py)."""
    found = contraction(node) if node.op == "call_function" else None
    if found is None or found[2].param.target not in ctx.tensors:
        return None
    act, weight, view, eq = found
    if not view.nodes and (len(view.param.users) > 1 or len(ctx.aliases(view.param.target)) > 1):
        return None  # a plain parameter read elsewhere too (a tied head): read as the other ops cut it
    segments = _segment_hint(node)
    return RuleSpec("weight_contract", {"act": act, "weight": weight, "view": view, "equation": eq,
                                        "owner": owner_path(view.param.target), "segments": segments,
                                        "heads": _heads([node], (_last_dim(node),)) if not segments else None,
                                        "needs": index_needs(node, eq, ctx.world_size)})  # which index to split


def _constant_positions(gm: GraphModule, node: Node) -> Optional[tuple[int, ...]]:
    """The positions of `x[..., [i, j], ...]` (one small constant index tensor, lifted by torch.export), if so."""
    ids = [i for i in node.args[1] if i is not None] if len(node.args) > 1 else []
    src = ids[0] if len(ids) == 1 and isinstance(ids[0], Node) else None
    while isinstance(src, Node) and src.op == "call_function" and src.target in _COPIES:
        src = src.args[0]
    t = gm
    for part in src.target.split(".") if isinstance(src, Node) and src.op == "get_attr" else [""]:
        t = getattr(t, part, None) if part else None
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() > 64 or t.is_floating_point():
        return None
    return tuple(int(v) for v in t.tolist())


_COPIES = (torch.ops.aten.lift_fresh_copy.default, torch.ops.aten.clone.default, torch.ops.aten.detach.default)


def _owner(node: Node, spec: RuleSpec, ctx: PassContext) -> Optional[str]:
    """The module a weight op belongs to: its weight's (a convolution's weight may be a view), or the caller's."""
    arg = node.args[spec.get("weight", 0)]
    w = (param_behind(arg, 0, depth=5) or (None,))[0] if spec.rule == "weight_conv" else weight_view(arg)[0]
    if w is None or w.target not in ctx.tensors:
        return None
    tied = len(ctx.aliases(w.target)) > 1
    return (module_path(node) if tied else "") or owner_path(w.target)


def _stacked_segments(reshape: Node, width: int) -> Optional[tuple[int, ...]]:
    """(..., k*E) reshaped to (..., k, ...) whose k dim is then unbound: k segments of E (q|k|v)."""
    shape = [int(s) if isinstance(s, int) else None for s in reshape.meta["val"].shape]
    prod, d = 1, len(shape)
    while d > 0 and shape[d - 1] is not None and prod < width:
        d -= 1
        prod *= shape[d]
    k = shape[d] if d < len(shape) else None
    runs = _unbound_later(reshape, d) if prod == width and k is not None and k > 1 and d != len(shape) - 1 else None
    if runs is None or sum(runs) != k:
        return None
    if any(split_along(u, d, len(shape)) and len({int(v.shape[d]) for v in u.meta["val"]}) > 1
           for u in reshape.users):
        return None  # cut into unequal runs of heads (q | k | v of multi-query): head_parts.py
    return tuple(r * (width // k) for r in runs)


def _unbound_later(node: Node, d: int) -> Optional[tuple[int, ...]]:
    """The runs dim d of node, followed through transposes and permutes, is cut into: one entry each when it is
    unbound or picked from, the pieces' sizes when it is split (DiffLlama's heads chunked into two halves)."""
    for _ in range(6):
        users = list(node.users)
        if not users:
            return None
        for u in users:
            spec = lookup(u.target)
            if spec is not None and spec.rule in ("unbind", "split", "select"):
                i = 2 if spec.rule == "split" else 1
                dim = u.args[i] if len(u.args) > i else u.kwargs.get("dim", 0)
                size = u.args[0].meta["val"].shape[d]
                if dim % u.args[0].meta["val"].dim() == d and isinstance(size, int):
                    return tuple(int(v.shape[d]) for v in u.meta["val"]) if spec.rule == "split" else (1,) * size
        if len(users) != 1:
            return None
        u = users[0]
        moved = _moved_dim(u, d)
        if moved is None and (lookup(u.target) is None or lookup(u.target).rule != "pointwise"):
            return None
        d, node = d if moved is None else moved, u
    return None


def _sliced_segments(node: Node, width: Optional[int]) -> Optional[tuple[tuple[int, ...], list[Node]]]:
    """Sizes of the slices along the last dim that tile it (`qkv[..., :q]`, `qkv[..., q:q + kv]`, ...), and the
    slices."""
    ndim = node.meta["val"].dim() if isinstance(node.meta.get("val"), torch.Tensor) else 0
    cuts: dict[tuple[int, int], Node] = {}
    for u in node.users:
        if u.target is not torch.ops.aten.slice.Tensor or not width:
            continue
        args = list(u.args) + [None] * (5 - len(u.args))
        if (args[1] or 0) % ndim != ndim - 1 or args[4] not in (None, 1):
            continue
        ends = [0 if args[2] is None else args[2], width if args[3] is None else args[3]]
        if not all(isinstance(e, int) for e in ends):
            return None
        cuts[tuple(min(width, e + width if e < 0 else e) for e in ends)] = u
    bounds = sorted(cuts)
    if len(bounds) < 2 or bounds[0][0] != 0 or bounds[-1][1] != width or any(
            a[1] != b[0] for a, b in zip(bounds, bounds[1:])):
        return None
    return tuple(b - a for a, b in bounds), [cuts[b] for b in bounds]


def _segment_hint(node: Node) -> Optional[tuple[int, ...]]:
    """Sizes a fused projection's output is split into along its last dim (q|k|v), if it is."""
    parts = _segment_parts(node)
    return parts[0] if parts else None


def _heads(parts: list[Optional[Node]], segments: tuple) -> Optional[tuple[Optional[int], ...]]:
    """Each segment's head size, where a reshape splits it into (heads, head size); a segment with none takes
    another's when it is a whole number of such heads (MQA's one key head). None when no segment has heads."""
    sizes = [_head_size(p, s) if p is not None and isinstance(s, int) else None for p, s in zip(parts, segments)]
    known = next((d for d in sizes if d), None)
    if known is None:
        return None
    return tuple(d or (known if isinstance(s, int) and s % known == 0 else None) for d, s in zip(sizes, segments))


def _along_heads(node: Node) -> bool:
    """True for a slice, a pick by positions or a part of a split, along the next-to-last dim (the heads of
    (.., heads, d))."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() < 2:
        return False
    if node.target is operator.getitem and isinstance(node.args[0], Node):
        return split_along(node.args[0], val.dim() - 2, val.dim())
    if node.target is torch.ops.aten.slice.Tensor:
        return len(node.args) > 1 and node.args[1] % val.dim() == val.dim() - 2
    return node.target is torch.ops.aten.index.Tensor and len(node.args[1]) == val.dim() - 1 \
        and node.args[1][-1] is not None and all(i is None for i in node.args[1][:-1])


def _head_size(value: Node, width: int) -> Optional[int]:
    """d for the first reshape after `value` (through elementwise ops, norms and transposes) to (..., h, d),
    h * d == width."""
    val = value.meta.get("val")
    if _along_heads(value) and all(isinstance(v, int) for v in val.shape[-2:]) \
            and val.shape[-2] * val.shape[-1] == width:  # a part cut from (.., heads, d) along the heads
        return int(val.shape[-1])
    todo, seen = [(value, False)], set()
    while todo and len(seen) < 12:
        n, mixed = todo.pop(0)
        for u in n.users:
            if u in seen:
                continue
            seen.add(u)
            spec = lookup(u.target)
            val = u.meta.get("val")
            heads = _heads_dim(val, width) if spec is not None and spec.rule in ("reshape", "view_as") else None
            # (.., h, d) or (.., h, 3, d): d or 3d a head; one head (multi-query) of the value, not of its product
            if heads is not None and _last_dim(n) == width and not (heads == 1 and mixed):
                return width // heads
            merged = [_merged_heads(i, width) for i in u.all_input_nodes if i is not n] \
                if spec is not None and spec.rule in POINTWISE else []
            if any(merged):  # times (or plus) attention's heads merged back: a gate of the same heads
                return next(d for d in merged if d)
            if spec is not None and spec.rule in (*POINTWISE, "transpose", "reshape", "norm") \
                    and _last_dim(u) == width:
                todo.append((u, mixed or any(i is not n and i.op != "get_attr" and _last_dim(i) == width
                                             for i in u.all_input_nodes)))
    return heads_through(value, width)


def _merged_heads(value: Node, width: int, depth: int = 6) -> Optional[int]:
    """d where `value` is (through elementwise ops and norms) a reshape of (.., h, d) to (.., h * d), h * d == width,
    h > 1: attention's heads merged back, which a gate multiplying them (AFMoE's, MiniMax's) splits alike."""
    spec = lookup(value.target) if value.op == "call_function" else None
    if depth <= 0 or spec is None or _last_dim(value) != width:
        return None
    src = value.args[0] if value.args and isinstance(value.args[0], Node) else None
    val = src.meta.get("val") if src is not None else None
    if spec.rule == "reshape" and isinstance(val, torch.Tensor) and val.dim() >= 2 \
            and all(isinstance(v, int) for v in val.shape[-2:]) and val.shape[-2] > 1 \
            and val.shape[-2] * val.shape[-1] == width:
        return int(val.shape[-1])
    if spec.rule not in (*POINTWISE, "reshape", "norm"):
        return None
    for i in value.all_input_nodes:  # the operands that are values (a norm's weight is a parameter read)
        if i.op != "get_attr" and (d := _merged_heads(i, width, depth - 1)):
            return d
    return None


def _heads_dim(val: object, width: int) -> Optional[int]:
    """h for a reshape's output (.., h, head_dim), (.., h, 3, head_dim) (q, k and v stacked per head, as
    Persimmon's fused projection) or (.., h, 1, head_dim) whose dims from h on hold `width` elements; multi-query's
    h is 1."""
    if not isinstance(val, torch.Tensor) or val.dim() < 2 or not isinstance(val.shape[-1], int):
        return None
    prod = int(val.shape[-1])
    for d in range(val.dim() - 2, -1, -1):
        if not isinstance(val.shape[d], int) or prod > width:
            return None
        prod *= int(val.shape[d])
        if prod == width:  # (.., h, d), (.., h, 3, d) with q, k and v stacked per head, or (.., h, 1, d); not
            # (kv, group, d)
            return int(val.shape[d]) if d >= val.dim() - 2 or val.dim() - d == 3 and val.shape[d + 1] in (1, 3) \
                else None
    return None


def _segment_parts(node: Node) -> Optional[tuple[tuple[int, ...], list[Optional[Node]]]]:
    """Sizes a fused projection's output is split into along its feature dim (q|k|v; the last dim, or where
    transposes move it, as Mamba's `in_proj(x).transpose(1, 2).chunk(2, dim=1)` does), and the value holding
    each part (None for a stacked (3, heads, dim) layout), if it is split."""
    width = _last_dim(node)
    return _walk(node, width, node.meta["val"].dim() - 1 if width else 0)  # fdim: where the features are in cur


def _walk(cur: Node, width: int, fdim: int, splits_only: bool = False) -> Optional[tuple[tuple, list]]:
    for _ in range(8):
        users = [u for u in cur.users if u.target not in _ASIDE]  # shape reads and export's metadata checks aside
        last = fdim == cur.meta["val"].dim() - 1
        for u in users:
            spec = lookup(u.target)
            vals = u.meta.get("val")
            if spec is not None and spec.rule == "split" and isinstance(vals, (list, tuple)):
                ndim = cur.meta["val"].dim()
                dim = u.args[2] if len(u.args) > 2 else u.kwargs.get("dim", 0)
                if dim % ndim == fdim:
                    got = {g.args[1]: g for g in u.users if g.target is operator.getitem}
                    return nested(tuple(int(v.shape[fdim]) for v in vals), [got.get(i) for i in range(len(vals))],
                                  fdim, _walk)
            if spec is not None and spec.rule == "reshape" and width and last and not splits_only:
                stacked = _stacked_segments(u, width)
                if stacked:
                    return stacked, [None] * len(stacked)
                headed = head_parts(u, width)
                if headed:
                    return headed
        sliced = _sliced_segments(cur, width) if last and not splits_only else None
        if sliced:
            return sliced
        if len(users) != 1:
            return None
        nxt = users[0]
        spec, moved = lookup(nxt.target), _moved_dim(nxt, fdim)
        if moved is not None and moved != fdim and nxt.target in (torch.ops.aten.transpose.int,
                                                                  torch.ops.aten.permute.default):
            fdim = moved  # the features move (channels first for a convolution)
        elif (not last or nxt.target is torch.ops.aten.cat.default) and keeps_features(nxt, cur, fdim):
            pass  # channels first, through a depthwise convolution, an activation, a cut or a cat of the tokens
        elif spec is None or spec.rule not in _FOLLOW or not last or _last_dim(nxt) != width:
            return None
        else:
            fdim = nxt.meta["val"].dim() - 1  # still the last dim
        cur = nxt
    return None
