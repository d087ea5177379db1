"""Heads repeated for the heads of other projections, fewer than the ranks: each group cut among the ranks sharing
its head.

A linear attention (Qwen3.5's and OLMo-Hybrid's gated delta rule) reads its query and key heads repeated, each for a
group of value heads (`repeat_interleave(q, n, dim)`), as grouped-query attention repeats its kv heads. With fewer
key heads than ranks, the world size a multiple of them and the ranks sharing a key head not dividing its group (2
key heads for 4 value heads at 6 ranks: 3 ranks a key head, 2 value heads for them), the value heads split one to a
rank would not line up with the repeated keys. Split as grouped-query attention is at such world sizes
(head_groups.py), each key head goes in a piece of its own (held by the ranks sharing it) and its group of value
heads is cut among those ranks, zero-padded (2 | ... 1 | 1 | 0 a rank; sharding_rules/group_cuts.py); the repeat
gives each rank its share of the group (`pad_within`, sharding_rules/layout_ops.py). Where the ranks do not divide
the key heads and the repeats padded one head a rank would not line up with the value heads padded so (2 key heads
for 4 value heads at 5 ranks: 2 repeated heads a rank against 1), each projection is padded by whole groups instead
(`unit`: a key head, or its group of value heads, a rank), as head_groups.py pads grouped-query attention.

This pass finds, per module, the repeats of heads that need it, the projections they repeat (the sources: in
pieces) and the projections whose values meet the repeated heads' descendants up to the module's row split (the
value, its gate, the per-head decay and step size: cut by groups, a unit a head of their own size). A fused
projection's segments are told apart by the split that parts them; each must be a source or met. Blamed later,
the cut is given up (head_groups.give_up_group_cuts) and propagation decides as it would without it.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
from torch.fx import GraphModule, Node

from tpcompile.passes.head_groups import add_args
from tpcompile.passes.head_projections import is_projection, projection
from tpcompile.passes.pass_context import PassContext, module_path
from tpcompile.sharding_rules import RuleSpec

_SPLITS = (torch.ops.aten.split_with_sizes.default, torch.ops.aten.split.Tensor)
_WALK = 8192  # nodes followed forward from the repeats (a chunked scan written out is long)
_CHAIN = 16  # ops between a split and the cat it undoes
_BACK = 256  # nodes walked back from a value to the projections it is computed from

Origin = tuple[Node, Optional[int]]  # a projection and its segment (None: the whole projection)


def mark_head_repeats(gm: GraphModule, ctx: PassContext) -> None:
    """Mark the repeats, sources and met projections of each module whose repeated heads need a group cut."""
    ws = ctx.world_size
    by_module: dict[str, list[Node]] = {}
    for n in gm.graph.nodes:
        spec = n.meta.get("tp_rule")
        found = _repeat(n, spec) if n.op == "call_function" and spec is not None else None
        if found and (_cut(*found, ws) or _whole_groups(*found, ws)):
            by_module.setdefault(module_path(n), []).append(n)
    for path, reps in by_module.items():
        kinds = {_repeat(r, r.meta["tp_rule"]) for r in reps}
        if len(kinds) == 1:
            _mark(path, reps, *kinds.pop(), ctx)


def _cut(heads: int, times: int, ws: int) -> bool:
    """Each head in a piece of its own shared by ranks that do not divide its group (one head: whole instead)."""
    return 1 < heads < ws and ws % heads == 0 and times % (ws // heads) != 0


def _whole_groups(heads: int, times: int, ws: int) -> bool:
    """Heads the ranks do not divide, whose repeats padded one to a rank would not line up with the repeated-for
    heads padded so (2 key heads for 4 value heads at 5 ranks: 2 repeated heads a rank against 1)."""
    return heads % ws != 0 and ws % heads != 0 and -(-heads // ws) * times != -(-heads * times // ws)


def _repeat(n: Node, spec: RuleSpec) -> Optional[tuple[int, int]]:
    """(heads, times) of a repeat_interleave of heads by a constant, else None."""
    if spec.rule != "repeat_interleave" or spec.get("pad_within"):
        return None
    i, j = spec.get("repeats_arg"), spec.get("dim_arg")
    times = n.args[i] if i < len(n.args) else None
    dim = n.args[j] if j < len(n.args) else n.kwargs.get("dim")
    val = n.args[0].meta.get("val") if isinstance(n.args[0], Node) else None
    if not isinstance(times, int) or not isinstance(dim, int) or not isinstance(val, torch.Tensor):
        return None
    heads = val.shape[dim]
    return (heads, times) if isinstance(heads, int) and times > 1 else None


def _mark(path: str, reps: list[Node], heads: int, times: int, ctx: PassContext) -> None:
    found = [_origins(r.args[0], ctx) for r in reps]
    reach = _descendants(reps, ctx)
    if any(len(o) != 1 for o in found) or reach is None:
        return
    sources = set().union(*found)
    outside = {i for n in reach for i in n.all_input_nodes  # the values the repeats' descendants meet
               if i not in reach and i.op == "call_function" and isinstance(i.meta.get("val"), torch.Tensor)}
    met = {o for i in outside for o in _origins(i, ctx) - sources
           if not path or o[0].meta["tp_rule"].get("owner", "").startswith(path + ".")}
    roles = _roles(sources, met, heads, times)
    if not roles or not met:
        return
    if _whole_groups(heads, times, ctx.world_size):  # each rank whole groups: a key head and its value heads
        for proj in roles:
            segments = proj.meta["tp_rule"].get("segments")
            add_args(proj, unit=tuple(s // heads for s in segments) if segments else
                     int(proj.meta["val"].shape[-1]) // heads)
        return
    share = ctx.world_size // heads
    found = tuple(roles)
    for proj, (unit, grouped) in roles.items():
        if unit is None:
            ctx.pieces[proj] = heads
        else:
            args = {"kv_groups": (heads, share, unit), **({"grouped": grouped} if grouped else {})}
            add_args(proj, **args)
        ctx.group_cuts[proj] = (found, tuple(reps), None, False, (), ())
    for r in reps:
        add_args(r, pad_within=True)


def _roles(sources: set, met: set, heads: int, times: int) -> Optional[dict]:
    """Per projection, (None, ()) when it is repeated (in pieces), else (its unit, the fused segments cut by groups);
    None when a projection cannot take its role (a segment neither repeated nor met, sizes the heads do not divide,
    a split decided already)."""
    out: dict = {}
    for proj in {o[0] for o in sources | met}:
        spec = proj.meta["tp_rule"]
        if spec.get("kv_groups") or spec.get("unit"):
            return None
        segments = spec.get("segments") or (int(proj.meta["val"].shape[-1]),)
        mine = {seg or 0: "met" if (p, seg) in met else "source" for p, seg in sources | met if p is proj}
        if sorted(mine) != list(range(len(segments))):
            return None
        units = {segments[s] // (heads * times) for s, role in mine.items() if role == "met"}
        if any(segments[s] % (heads * times if role == "met" else heads) for s, role in mine.items()) \
                or len(units) > 1:
            return None
        if not units and len(segments) > 1:  # a fused projection only repeated: in pieces as a whole
            return None
        grouped = tuple(s for s, role in sorted(mine.items()) if role == "met") if len(segments) > 1 else ()
        out[proj] = (units.pop() if units else None, grouped)
    return out


def _descendants(reps: list[Node], ctx: PassContext) -> Optional[set]:
    """The nodes computed from the repeats, up to the weight ops (the row split after them); None past the bound."""
    reach: set = set()
    todo = list(reps)
    while todo:
        n = todo.pop()
        if n in reach:
            continue
        reach.add(n)
        if len(reach) > _WALK:
            return None
        todo.extend(u for u in n.users if u.op == "call_function" and not is_projection(u, ctx))
    return reach


def _origins(n: Node, ctx: PassContext) -> set:
    """The projections a value is computed from (walked back to the first weight ops) and, for a fused one, the
    segments it reads (the getitems of the split that parts them on the way)."""
    todo, seen, projs, parts = [n], set(), [], []
    while todo and len(seen) < _BACK:
        m = todo.pop()
        if m in seen or not isinstance(m, Node) or m.op != "call_function":
            continue
        seen.add(m)
        if is_projection(m, ctx):
            projs.append(m)
            continue
        if m.target is operator.getitem and isinstance(m.args[0], Node) and m.args[0].target in _SPLITS:
            joined = _joined(m.args[0], m.args[1])
            if joined is not None:  # the split parts what a cat joined: this part is that input's
                todo.append(joined)
                continue
            parts.append(m)
        todo.extend(m.all_input_nodes)
    out: set = set()
    for proj in projs:
        segments = proj.meta["tp_rule"].get("segments")
        if not segments:
            out.add((proj, None))
            continue
        for g in parts:
            split = g.args[0]
            vals = split.meta.get("val")
            dim = split.args[2] if len(split.args) > 2 else 0
            if isinstance(vals, (list, tuple)) and [int(t.shape[dim]) for t in vals] == list(segments) \
                    and projection(split.args[0], ctx) is proj:
                out.add((proj, g.args[1]))
    return out


def _joined(split: Node, i: int) -> Optional[Node]:
    """The input `i` of a cat that `split` undoes (the same sizes, through the first inputs of the ops between:
    OLMo-Hybrid's q, k and v joined for one short convolution), else None."""
    m = split.args[0]
    for _ in range(_CHAIN):
        if not isinstance(m, Node):
            return None
        if m.target is torch.ops.aten.cat.default:
            parts, whole = m.args[0], m.meta.get("val")
            dim = m.args[1] if len(m.args) > 1 else 0
            vals = split.meta.get("val")
            sdim = split.args[2] if len(split.args) > 2 else 0
            if isinstance(vals, (list, tuple)) and whole is not None and len(parts) == len(vals) \
                    and [p.meta["val"].shape[dim] for p in parts] == [t.shape[sdim] for t in vals]:
                return parts[i]
            return None
        m = m.args[0] if m.op == "call_function" and m.args else None  # the data an op of one input reads
    return None
