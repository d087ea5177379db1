"""Placements and slices: how a value is laid out across ranks, and which part of it each rank holds.

Placements follow DTensor's vocabulary (Replicate, Shard) with extra fields for the layouts
real models produce; a ParamSlice says how a parameter is cut. Every piece of slice
arithmetic (which runs a rank holds, local shapes) lives here.

`Shard` carries optional `segments`: the sharded dimension is a concatenation of segments
(for example a fused q|k|v projection of sizes (C, C, C)) and every segment is split evenly
across ranks, so a rank holds the concatenation of its piece of each segment. A plain shard
is the one-segment case. DTensor's `Shard(dim)` has no segments, hence these small types.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence, Union

from tpcompile.layouts import dim_layout

Padding = Union[int, tuple[int, ...]]
Cuts = tuple[tuple[int, ...], ...]  # per segment, world_size + 1 positions (layouts.DimLayout's Segment.cuts)


@dataclass(frozen=True)
class Replicate:
    """Every rank holds the whole value."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class ParamSlice:
    """How a parameter is cut: along `dim`, per segment when segmented."""

    dim: int
    segments: Optional[tuple[int, ...]] = None
    padded: Optional[Padding] = None  # cut as if zero-padded to this size (per segment: a tuple of sizes)
    pieces: Optional[int] = None  # cut into this many pieces, each held by world_size/pieces ranks
    seg_pieces: Optional[tuple[int, ...]] = None  # per segment, its number of pieces (world size: split evenly)
    cuts: Optional[Cuts] = None  # per segment, explicit per-rank cut positions (Shard.cuts)


@dataclass(frozen=True)
class Shard:
    """Each rank holds 1/world_size of dimension `dim` (of every segment, when segmented)."""

    dim: int
    segments: Optional[tuple[int, ...]] = None
    seq: bool = False  # sequence parallel: tokens split outside the tensor-parallel regions
    # size rounded up to a multiple of the world size (zeros past the end); with segments, a tuple: each
    # segment's own padded size, so that a rank holds its block of each padded segment (q|k|v by whole heads)
    padded: Optional[Padding] = None
    outer: Optional[object] = None  # the dim is `outer` repetitions of the split blocks (batch x heads)
    pieces: Optional[int] = None  # only this many distinct pieces; ranks r*pieces//ws share a piece
    split_next: Optional[int] = None  # with pieces: dim+1 is split this many ways within a piece
    # per segment, how many distinct pieces it has (fused q|k|v with fewer kv heads than ranks); None: all even
    seg_pieces: Optional[tuple[int, ...]] = None
    # with segments: per segment, world_size + 1 cut positions, rank r holding [cuts[r], cuts[r+1]) of the segment
    # zero-padded to cuts[-1] (query heads of kv groups split within the ranks sharing each group: `group_cuts`)
    cuts: Optional[Cuts] = None

    def __str__(self) -> str:
        if self.cuts is not None:  # 'S(1|3:2.1~4+...)': a segment's size, the real part of each non-empty piece
            segs = "+".join(f"{s}:" + ".".join(str(min(b, s) - min(a, s)) for a, b in zip(c, c[1:]) if b > a)
                            + f"~{c[-1]}" for s, c in zip(self.segments, self.cuts))
            return f"S({self.dim}|{segs}){'seq' if self.seq else ''}"
        seg = "" if self.segments is None else f"|{'+'.join(map(str, self.segments))}"
        if self.seg_pieces is not None:
            seg = "|" + "+".join(f"{s}/{g}" for s, g in zip(self.segments, self.seg_pieces))
        pad = "" if self.padded is None else f"~{'+'.join(map(str, padding_sizes(self.padded)))}"
        out = "" if self.outer is None else f"x{self.outer}"
        grp = "" if self.pieces is None else f"/{self.pieces}" + ("" if self.split_next is None else f"+{self.split_next}")
        return f"S({self.dim}{seg}{pad}{out}{grp}){'seq' if self.seq else ''}"

    @property
    def plain(self) -> bool:
        """True when the dimension is one segment split evenly, without padding."""
        return ((self.segments is None or len(self.segments) == 1) and self.padded is None
                and self.outer is None and self.pieces is None and self.seg_pieces is None and self.cuts is None)

    @property
    def plain_padded(self) -> bool:
        """True when the dimension is one segment zero-padded to a multiple of the world size and split evenly."""
        return (self.padded is not None and (self.segments is None or len(self.segments) == 1)
                and self.outer is None and self.pieces is None and self.seg_pieces is None and not self.seq
                and self.cuts is None)


@dataclass(frozen=True)
class Partial:
    """Each rank holds a summand and the value is their sum: a row split's result before its all-reduce.

    It stays pending through ops linear in it (reshapes, scaling by a whole value, sums, gathers of
    rows, adding other pending sums), so that the expert outputs of a mixture of experts are
    combined locally and reduced once (sharding_rules/partial.py decides; DTensor's Partial("sum")).
    """

    def __str__(self) -> str:
        return "P"


Placement = Union[Replicate, Shard, Partial]
REPLICATE = Replicate()
PARTIAL = Partial()


def shard(dim: int, segments: Optional[Sequence[int]] = None) -> Shard:
    """A Shard with a one-segment list normalised to a plain shard."""
    segs = None if segments is None or len(segments) <= 1 else tuple(int(s) for s in segments)
    return Shard(dim, segs)


def shard_of(dim: int, segments: Sequence[int], seg_pieces: Optional[Sequence[int]], world_size: int) -> Shard:
    """A Shard of `segments` with per-segment piece counts, normalised: one segment of g < world_size pieces is
    a `pieces` shard; segments all split evenly are plain segments."""
    gs = list(seg_pieces or [world_size] * len(segments))
    if all(g == world_size for g in gs):
        return shard(dim, segments)
    if len(segments) == 1:
        return Shard(dim, pieces=gs[0])
    return Shard(dim, tuple(int(s) for s in segments), seg_pieces=tuple(gs))


def local_sizes(segments: Sequence[int], seg_pieces: Optional[Sequence[int]], world_size: int,
                padded: Optional[Padding] = None) -> list[int]:
    """Each segment's size on one rank (of its padded size when the segments are padded each)."""
    sizes = padded if isinstance(padded, tuple) else segments
    return [s // g for s, g in zip(sizes, seg_pieces or [world_size] * len(segments))]


def padding_sizes(padded: Padding) -> tuple[int, ...]:
    """A padding as a tuple of sizes: one for a padded dim, one per segment for padded segments."""
    return padded if isinstance(padded, tuple) else (int(padded),)


def padded_local(padded: Padding, seg_pieces: Optional[Sequence[int]], world_size: int) -> int:
    """A padded dim's size on one rank: each (padded) segment over its pieces (the world size by default)."""
    pads = padding_sizes(padded)
    return sum(p // g for p, g in zip(pads, seg_pieces or [world_size] * len(pads)))


def padded_segment_runs(segments: Sequence[int], padded: Sequence[int], rank: int, world_size: int,
                        seg_pieces: Optional[Sequence[int]] = None) -> list[tuple[int, int, int, int]]:
    """Per segment, (global start, local start, length of real data, local block) of what `rank` holds when
    each segment is zero-padded to its own size and cut into its pieces (the world size, or g < world size
    pieces each held by world_size / g ranks, unpadded: multi-query's one kv head whole on every rank)."""
    cut = ParamSlice(0, tuple(segments), tuple(padded), None, tuple(seg_pieces) if seg_pieces else None)
    return dim_layout(cut, None, world_size).runs(rank)


def cut_from_shared(have: object, want: object) -> bool:
    """True when `want` is cut locally from `have`, a value in pieces each shared by several ranks: from one piece
    every rank holds whole (`Shard(d, pieces=1)`: multi-query's kv head repeated over the query heads), a
    zero-padded split; from g pieces (k heads repeated over 4 v heads at 4 ranks: 2 pieces), an even split,
    rank r's block lying in its piece."""
    if not isinstance(have, Shard) or not isinstance(want, Shard) or want.dim != have.dim or not have.pieces:
        return False
    if have.pieces == 1:
        return want.plain_padded
    return want.plain and have.segments is None and have.split_next is None and have.outer is None \
        and have.padded is None and not have.seq


def is_seq(p: object) -> bool:
    """True for a sequence-parallel (token) sharding."""
    return isinstance(p, Shard) and p.seq


def moved(p: Shard, dim: int) -> Shard:
    """The same sharding (segments, sequence flag) on another dim."""
    return replace(p, dim=dim)


def split_dims(p: Shard) -> tuple[int, ...]:
    """The dims a split cuts: its dim, and the next one too when it is split within each piece (`split_next`)."""
    return (p.dim, p.dim + 1) if p.split_next else (p.dim,)


def padded_size(size: int, world_size: int) -> int:
    """`size` rounded up to a multiple of the world size."""
    return -(-size // world_size) * world_size


def rank_pieces(sl: Any, full: int, rank: int, world_size: int) -> list[tuple[int, int, int]]:
    """(global start, local start, length) of each run along sl.dim of a cut parameter that `rank` holds.

    `sl` is a ParamSlice (dim, segments, padded, pieces); padding is left out, so the local
    positions past the last run are the zero padding.
    """
    return [(a, loc, n) for a, loc, n, _ in dim_layout(sl, full, world_size).runs(rank) if n > 0]


def slice_shape(shape: Sequence[int], sl: Any, world_size: int) -> tuple[int, ...]:
    """A parameter's shape on one rank when cut by ParamSlice `sl` (None: whole)."""
    if sl is None:
        return tuple(shape)
    out = list(shape)
    out[sl.dim] = dim_layout(sl, shape[sl.dim], world_size).local_size(0)
    return tuple(out)


def segment_ranges(size: int, segments: Optional[Sequence[int]], rank: int, world_size: int,
                   seg_pieces: Optional[Sequence[int]] = None) -> list[tuple[int, int]]:
    """The [start, stop) index ranges along a sharded dim that `rank` holds (a segment of g < world_size
    pieces: piece rank // (world_size / g) of it, shared with the other ranks of that group)."""
    cut = ParamSlice(0, tuple(segments) if segments else None, None, None, tuple(seg_pieces) if seg_pieces else None)
    return dim_layout(cut, size, world_size).blocks(rank)


def slice_placement(sl: ParamSlice) -> Shard:
    """The placement of a parameter cut by `sl`, as its readers see it."""
    if sl.cuts is not None:
        return Shard(sl.dim, sl.segments, cuts=sl.cuts)
    return Shard(sl.dim, sl.segments if sl.segments and len(sl.segments) > 1 else None, padded=sl.padded,
                 pieces=sl.pieces, seg_pieces=sl.seg_pieces)


def local_shape(shape: Sequence[Any], p: Any, rank: int, world_size: int) -> tuple:
    """The shape rank `rank` holds of a value of global `shape` placed as `p` (sizes may be symbolic)."""
    out = list(shape)
    if not isinstance(p, Shard) or p.dim >= len(out):
        return tuple(out)
    size = out[p.dim]
    if p.cuts is not None:
        out[p.dim] = dim_layout(p, None, world_size).local_size(rank)
    elif p.pieces:
        out[p.dim] = size // p.pieces
        if p.split_next and p.dim + 1 < len(out):  # a group the sharing ranks do not divide: padded, its ceil
            nxt = out[p.dim + 1]
            out[p.dim + 1] = -(-nxt // p.split_next) if isinstance(nxt, int) else nxt // p.split_next
    elif p.padded:  # `outer` repetitions of padded heads (batch x heads), or the padded dim once
        out[p.dim] = (1 if p.outer is None else p.outer) * dim_layout(p, None, world_size).local_size(rank)
    elif p.segments and isinstance(size, int):
        out[p.dim] = dim_layout(p, size, world_size).local_size(rank)
    else:
        out[p.dim] = size // world_size
    return tuple(out)


def shape_key(shape: Sequence[Any]) -> tuple[str, ...]:
    """A shape as expressions ('s0', 's1//2', '64'), so symbolic sizes compare as expressions."""
    return tuple(str(s) for s in shape)


def group_cuts(groups: int, size: int, unit: int, share: int, world_size: int) -> Cuts:
    """The cuts of `groups` segments of `size` elements (whole units of `unit`), segment k split among the `share`
    ranks k * share ... (k + 1) * share - 1 only, each holding ceil(units / share) units (the last ones zeros): a
    kv group's query heads split within the ranks that share its kv head (3 heads at 2 ranks: 2 | 1 and a zero
    head)."""
    per = -(-(size // unit) // share) * unit
    return tuple(tuple(min(max(r - k * share, 0), share) * per for r in range(world_size + 1))
                 for k in range(groups))
