"""Query heads of a kv group split within the ranks that share its kv head, the group zero-padded (`Shard.cuts`).

With kv heads in pieces (each held by `share` = world_size / kv ranks) and a group of query heads that `share`
does not divide (12 query heads on 4 kv heads at 8 ranks: groups of 3 at 2 ranks), rank k * share + i holds
query heads i * c ... (i + 1) * c - 1 of group k, c = ceil(group / share), the heads past the group zeros
(2 | 1 and a zero head), and a copy of kv head k for each. The layout of the heads dim is explicit: segment k
(group k) cut only among its ranks (`group_cuts`). It arises where grouped-query attention repeats
the kv heads (`expand` marked `pad_within` by passes/head_groups.py, whose query projection's split it
matches), and follows views that split or merge the heads dim with the dims after it.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

from tpcompile.layouts import dim_layout, holder_runs, holders, within_cut
from tpcompile.placement import Cuts, Shard
from tpcompile.sharding_rules.rule_context import Size, prod, sizes_equal


def group_cuts(groups: int, size: int, unit: int, share: int, world_size: int) -> Cuts:
    """The cuts of `groups` segments of `size` elements (whole units of `unit`), segment k split among the `share`
    ranks k * share ... (k + 1) * share - 1 only (the last segment among the ranks left), each holding `per_rank`
    units (the last ones zeros): a kv group's query heads split within the ranks that share its kv head (3 heads
    at 2 ranks: 2 | 1 and a zero head)."""
    per = per_rank(size // unit, groups, world_size) * unit
    return tuple(tuple(min(max(r - k * share, 0), share) * per for r in range(world_size + 1))
                 for k in range(groups))


def per_rank(units: int, groups: int, world_size: int) -> int:
    """The units every rank holds of its group when each of `groups` groups of `units` is cut among the ranks
    holding it (`layouts.holder_runs`): as many as the fewest ranks holding a group need (the last group's, when
    the groups do not divide the ranks: 3 heads at 5 ranks for 2 groups, ranks 0-2 and 3-4, are 2 a rank), so
    that every rank's share has one size."""
    return -(-units // min(len(r) for r in holder_runs(world_size, groups)))


def even_within(units: int, share: int, groups: int, world_size: int) -> bool:
    """True when every group's units split evenly among the ranks holding it (all groups held by `share` ranks)."""
    return units % share == 0 and groups * share == world_size


def expand_within(p: Shard, out: Shard, ins: Sequence[Size], outs: Sequence[Size], pad_within: bool,
                  ws: int) -> tuple[Shard, list]:
    """An expand's output split `out` and its sizes to localize: a dim of 1 right after kv heads in pieces,
    broadcast to a group, is cut within each piece (`Shard.within`) where the group splits evenly among the ranks
    holding each piece, or, for repeats marked `pad_within`, `per_rank` a rank, zero-padded."""
    nxt = p.dim + 1
    share = holders(ws, p.pieces) if p.pieces else None
    if share and p.within is None and nxt < len(ins) and ins[nxt] == 1 and isinstance(outs[out.dim + 1], int):
        group = outs[out.dim + 1]
        if even_within(group, share, p.pieces, ws):
            out = replace(out, within=within_cut(group, share))
        elif pad_within and p.pieces == ins[p.dim]:
            out = replace(out, within=within_cut(group, share, per_rank(group, p.pieces, ws)))
    loc = [("shape", 1, out.dim, out.pieces)]
    if out.within is not None:
        loc.append(within_size(out, 1, out.dim + 1))
    return out, loc


def within_size(p: Shard, arg: int, dim: int) -> tuple:
    """How a size literal (argument `arg`, position `dim`) of the dim cut within pieces (`Shard.within`) is made
    this rank's: divided by the pieces when they cut it evenly, else set to a piece's size, its zeros included."""
    cut = p.within
    return ("shape", arg, dim, cut.pieces) if cut.cuts[-1] == cut.size else ("shape_set", arg, (dim, cut.cuts[1]), None)


def padded_groups(p: Shard, ins: Sequence[Size], ws: int) -> Optional[Shard]:
    """(kv heads in pieces, group split within each piece) merged into one heads dim, as explicit cuts, when the
    ranks sharing a piece do not divide the group (one kv head a piece); else None."""
    kv, group = ins[p.dim], ins[p.dim + 1]
    if not isinstance(kv, int) or not isinstance(group, int) or p.pieces != kv \
            or even_within(group, p.split_next, kv, ws):
        return None
    return Shard(p.dim, (group,) * kv, cuts=group_cuts(kv, group, 1, p.split_next, ws))


def cuts_reshape(p: Shard, gi: list, gj: list, ins: Sequence[Size], outs: Sequence[Size]) -> tuple:
    """Where an explicitly cut dim lands after a reshape: split into (units, inner...) with the cut dim first, or
    merged with the dims after it; (None, why) for anything else."""
    why = f"reshape of {tuple(ins)} to {tuple(outs)} cuts through the explicit per-rank pieces of dim {p.dim}"
    if gi == [p.dim]:  # split into (units, inner...): the first output dim holds the units
        inner = prod([outs[d] for d in gj[1:]])
        if isinstance(inner, int) and all(s % inner == 0 for s in p.segments) \
                and all(c % inner == 0 for cut in p.cuts for c in cut):
            return _scaled(replace(p, dim=gj[0]), 1, inner), ""
        return None, why
    if gi[0] == p.dim and len(gj) == 1 and p.outer is None:  # merged with the dims after it
        inner = prod([ins[d] for d in gi[1:]])
        if isinstance(inner, int):
            return _scaled(replace(p, dim=gj[0]), inner, 1), ""
    if p.outer is None and gi[-1] == p.dim and len(gi) > 1:  # folded with the dims before it, (B, T, h, d) ->
        inner, count = prod([outs[d] for d in gj[1:]]), prod([ins[d] for d in gi[:-1]])  # (B*T*h, d), its
        if isinstance(inner, int) and all(s % inner == 0 for s in p.segments) \
                and all(c % inner == 0 for cut in p.cuts for c in cut) \
                and sizes_equal(outs[gj[0]], count * (sum(p.segments) // inner)):  # entries split off: (B, T, h*d)
            return _scaled(replace(p, dim=gj[0], outer=count), 1, inner), ""
    if p.outer is not None and gi[0] == p.dim and len(gj) > 1:  # unfolded, merged with the dims after it:
        inner = prod([ins[d] for d in gi[1:]])  # (B*T*h, d) -> (B, T, h*d)
        if isinstance(inner, int) and sizes_equal(outs[gj[-1]], sum(p.segments) * inner) \
                and sizes_equal(prod([outs[d] for d in gj[:-1]]), p.outer):
            return _scaled(replace(p, dim=gj[-1], outer=None), inner, 1), ""
    return None, why


def inferred(shape: object, dim: int) -> bool:
    """True when a view's size of `dim` is -1 (inferred: heads folded into rows take their local count so)."""
    return isinstance(shape, (list, tuple)) and dim < len(shape) and isinstance(shape[dim], int) and shape[dim] == -1


def _scaled(p: Shard, times: int, over: int) -> Shard:
    """The same cuts in units `times / over` as large."""
    return replace(p, segments=tuple(s * times // over for s in p.segments),
                   cuts=tuple(tuple(c * times // over for c in cut) for cut in p.cuts))


def cuts_local(p: Shard, ws: int) -> Optional[int]:
    """The size of an explicitly cut dim on every rank, when it is the same on all (else None)."""
    layout = dim_layout(p, None, ws)
    sizes = {layout.local_size(r) for r in range(ws)}
    return sizes.pop() if len(sizes) == 1 else None
