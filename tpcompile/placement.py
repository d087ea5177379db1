"""Placements and slices: how a value is laid out across ranks, and which part of it each rank holds.

Placements follow DTensor's vocabulary (Replicate, Shard); a ParamSlice says how a parameter is cut. A split dim
is `segments` (a fused q|k|v projection's (C, C, C); none: one) each split evenly across the ranks, or cut at
`cuts`, each segment's piece bounds (`Cut` reads them: pieces fewer than ranks, zero padding, one piece a rank),
the value `layouts.DimLayout` computes on. DTensor's `Shard(dim)` has no segments, hence these small types.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence, Union

from tpcompile.layouts import Segment, block_of, dim_layout, even_cuts, is_even, token_shares

Cuts = tuple[tuple[int, ...], ...]  # per segment, the bounds of its pieces (layouts.DimLayout's Segment.cuts)


@dataclass(frozen=True)
class Replicate:
    """Every rank holds the whole value."""

    def __str__(self) -> str:
        return "R"


class Cut:
    """What `segments` and `cuts` say of a split dim, for a ParamSlice and a Shard alike. Cuts without segments are
    one segment, the whole dim, cut evenly past its size: a zero-padded split (`padded`)."""

    segments: Optional[tuple[int, ...]]
    cuts: Optional[Cuts]

    @property
    def padded(self) -> Optional[int]:
        """The size a one-segment split is zero-padded to (its cuts' last bound), else None."""
        return self.cuts[0][-1] if self.cuts is not None and self.segments is None else None

    @property
    def padding(self) -> Optional[Union[int, tuple[int, ...]]]:
        """What the dim is zero-padded to: one size (`padded`), each evenly cut segment's, or None."""
        return tuple(self.pads()) if self.seg_padded else self.padded

    @property
    def rank_cuts(self) -> bool:
        """True for cuts that give each rank a piece of its own (`group_cuts`: some pieces differ in size, or one
        segment zero-padded), as opposed to segments cut evenly (`even_segments`, one segment in equal pieces
        shared by ranks included: `pieces`) and a padded split (`padded`)."""
        return self.cuts is not None and self.segments is not None and (
            (len(self.cuts) == 1 and self.cuts[0][-1] != self.segments[0]) or not all(is_even(c) for c in self.cuts))

    @property
    def even_segments(self) -> bool:
        """True for segments each cut evenly into its own count of pieces, zero-padded or not (a fused q|k|v
        padded by whole heads, or with kv heads fewer than ranks)."""
        return self.cuts is not None and self.segments is not None and not self.rank_cuts

    @property
    def seg_padded(self) -> bool:
        """True when evenly cut segments are zero-padded each (a fused q|k|v padded by whole heads)."""
        return self.even_segments and any(c[-1] != s for s, c in zip(self.segments, self.cuts))

    @property
    def pieces(self) -> Optional[int]:
        """The count of a cut of the whole dim, one segment, into equal pieces each shared by several ranks
        (`piece_cut`, `piece_shard`: kv heads fewer than the ranks), else None."""
        if self.even_segments and len(self.cuts) == 1 and self.cuts[0][-1] == self.segments[0]:
            return len(self.cuts[0]) - 1
        return None

    def counts(self, world_size: int) -> list[int]:
        """Each segment's number of pieces (the world size when split evenly)."""
        segs = self.segments or (None,)
        return [len(c) - 1 for c in self.cuts] if self.cuts is not None else [world_size] * len(segs)

    def shared(self, world_size: int) -> bool:
        """True when an evenly cut segment has fewer pieces than ranks (kv heads of a fused q|k|v fewer than
        ranks: each piece held by several ranks)."""
        return self.even_segments and self.fewer(world_size)

    def fewer(self, world_size: int) -> bool:
        """True when some segment has fewer pieces than ranks, each held by several ranks (cut evenly or not)."""
        return self.cuts is not None and any(len(c) - 1 < world_size for c in self.cuts)

    def pads(self) -> list[int]:
        """Each segment's size zero-padded (its size when not padded)."""
        return [c[-1] for c in self.cuts] if self.cuts is not None else list(self.segments)

    def seg_local(self, world_size: int) -> list[int]:
        """Each evenly cut segment's size on one rank, its padding included."""
        return [q // g for q, g in zip(self.pads(), self.counts(world_size))]


@dataclass(frozen=True)
class ParamSlice(Cut):
    """How a parameter is cut: along `dim`, per segment when segmented."""

    dim: int
    segments: Optional[tuple[int, ...]] = None
    cuts: Optional[Cuts] = None  # per segment, the bounds of its pieces (Shard.cuts); in pieces: `piece_cut`


@dataclass(frozen=True)
class Shard(Cut):
    """Each rank holds its piece of dimension `dim`: 1/world_size of it, or of every segment when segmented. The
    fields but `dim` and `seq` spell one `layouts.DimLayout` (`dim_layout` reads them): its segments and their cuts,
    its repetitions (`outer`) and the next dim's cut (`within`)."""

    dim: int
    segments: Optional[tuple[int, ...]] = None
    seq: bool = False  # sequence parallel: tokens split outside the tensor-parallel regions
    outer: Optional[object] = None  # the dim is `outer` repetitions of the split blocks (batch x heads): `repeat`
    within: Optional[Segment] = None  # with `pieces`: dim+1's cut among each piece's ranks (layouts.within_cut)
    # per segment, the bounds of its pieces in the segment zero-padded to cuts[-1], a segment of g pieces held by
    # the ranks k * ws / g ... (k + 1) * ws / g - 1 (layouts.DimLayout); without segments, a zero-padded split
    # (`padded`); None: every segment split evenly, unpadded (`Cut` reads the kinds)
    cuts: Optional[Cuts] = None

    def __str__(self) -> str:
        if self.pieces is not None:  # 'S(2/2)': one segment in pieces shared by ranks
            grp = f"/{self.pieces}" + ("" if self.split_next is None else f"+{self.split_next}")
            return f"S({self.dim}{'' if self.outer is None else f'x{self.outer}'}{grp}){'seq' if self.seq else ''}"
        if self.rank_cuts:  # 'S(1|3:2.1~4+...)': a segment's size, the real part of each non-empty piece
            segs = "+".join(f"{s}:" + ".".join(str(min(b, s) - min(a, s)) for a, b in zip(c, c[1:]) if b > a)
                            + f"~{c[-1]}" for s, c in zip(self.segments, self.cuts))
            return f"S({self.dim}|{segs}){'seq' if self.seq else ''}"
        seg = "" if self.segments is None else f"|{'+'.join(map(str, self.segments))}"
        pads = None if self.padded is None else (self.padded,)
        if self.even_segments:
            counts = [len(c) - 1 for c in self.cuts]
            if self.seg_padded:
                pads = tuple(c[-1] for c in self.cuts)
            if not self.seg_padded or len(set(counts)) > 1:  # pieces fewer than ranks: each segment's count
                seg = "|" + "+".join(f"{s}/{g}" for s, g in zip(self.segments, counts))
        pad = "" if pads is None else f"~{'+'.join(map(str, pads))}"
        out = "" if self.outer is None else f"x{self.outer}"
        return f"S({self.dim}{seg}{pad}{out}){'seq' if self.seq else ''}"

    @property
    def split_next(self) -> Optional[int]:
        """How many ways dim+1 is cut among the ranks holding each piece (`within`), else None."""
        return None if self.within is None else self.within.pieces

    @property
    def plain(self) -> bool:
        """True when the dimension is one segment split evenly, without padding."""
        return ((self.segments is None or len(self.segments) == 1) and self.cuts is None
                and self.outer is None and self.pieces is None)

    @property
    def in_pieces(self) -> bool:
        """True for one segment in equal pieces, each shared by several ranks, nothing else (heads fewer than ranks)."""
        return self.pieces is not None and self.split_next is None and self.outer is None and not self.seq

    @property
    def plain_padded(self) -> bool:
        """True when the dimension is one segment zero-padded to a multiple of the world size and split evenly."""
        return self.padded is not None and self.outer is None and self.pieces is None and not self.seq


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


def pad_cuts(padded: int, world_size: int) -> Cuts:
    """The cuts of a one-segment split zero-padded to `padded` (a multiple of the world size): even, one a rank."""
    return (even_cuts(int(padded), world_size),)


def piece_cut(dim: int, size: int, pieces: int) -> ParamSlice:
    """A parameter's dim of `size` cut into `pieces` equal pieces, each held by `holders` ranks (kv heads
    fewer than the ranks): one segment, one even cut."""
    return ParamSlice(dim, (int(size),), cuts=(even_cuts(int(size), int(pieces)),))


def piece_shard(dim: int, size: Any, pieces: int, **kw: Any) -> Shard:
    """A Shard of dim `dim` (of `size` elements, or of `outer` repetitions of them) cut into `pieces` equal pieces,
    each held by `holders` ranks (kv heads fewer than the ranks; one piece: whole on every rank, `size` possibly a
    run-time size)."""
    cut = (0, size) if pieces == 1 else even_cuts(int(size), int(pieces))
    return Shard(dim, (size if pieces == 1 else int(size),), cuts=(cut,), **kw)


def param_cut(p: Shard, size: int) -> ParamSlice:
    """The cut of a parameter's dim of `size` laid out as `p` (its dim, segments and cuts; pieces of that size)."""
    if p.pieces:
        return piece_cut(p.dim, size, p.pieces)
    return ParamSlice(p.dim, p.segments, cuts=p.cuts)


def seg_cuts(segments: Sequence[int], world_size: int, pads: Optional[Sequence[int]] = None,
             counts: Optional[Sequence[int]] = None) -> Optional[Cuts]:
    """Each segment cut evenly: zero-padded to its pad, into its count of pieces (the world size by default);
    None when every segment is split evenly over the ranks without padding (a plain segmented Shard)."""
    pads = list(pads or segments)
    counts = list(counts or [world_size] * len(segments))
    if pads == list(segments) and all(g == world_size for g in counts):
        return None
    return tuple(even_cuts(int(q), int(g)) for q, g in zip(pads, counts))


def segmented(dim: int, segments: Sequence[int], world_size: int, pads: Optional[Sequence[int]] = None,
              counts: Optional[Sequence[int]] = None) -> Shard:
    """A Shard of whole segments, each zero-padded to its pad and cut into its count of pieces, normalised: one
    segment is plain, `pieces` (fewer pieces than ranks) or `padded`; segments split evenly are plain segments."""
    segs = [int(s) for s in segments]
    pads = list(pads or segs)
    counts = list(counts or [world_size] * len(segs))
    if len(segs) == 1 and pads[0] != segs[0]:
        return Shard(dim, cuts=pad_cuts(pads[0], world_size))
    if len(segs) == 1 and counts[0] < world_size:
        return piece_shard(dim, segs[0], int(counts[0]))
    if len(segs) == 1:
        return Shard(dim)
    return Shard(dim, tuple(segs), cuts=seg_cuts(segs, world_size, pads, counts))


def cut_shard(dim: int, segments: Sequence[int], cuts: Cuts, world_size: int) -> Shard:
    """A Shard of `segments` cut at `cuts`, normalised: `segmented` when each segment is cut evenly."""
    if all(is_even(c) for c in cuts):
        return segmented(dim, segments, world_size, [c[-1] for c in cuts], [len(c) - 1 for c in cuts])
    return Shard(dim, tuple(segments), cuts=tuple(cuts))


def is_seq(p: object) -> bool:
    """True for a sequence-parallel (token) sharding."""
    return isinstance(p, Shard) and p.seq


def moved(p: Shard, dim: int) -> Shard:
    """The same sharding (segments, sequence flag) on another dim."""
    return replace(p, dim=dim)


def split_dims(p: Shard) -> tuple[int, ...]:
    """The dims a split cuts: its dim, and the next one too when it is split within each piece (`within`)."""
    return (p.dim, p.dim + 1) if p.split_next else (p.dim,)


def padded_size(size: int, world_size: int) -> int:
    """`size` rounded up to a multiple of the world size."""
    return -(-size // world_size) * world_size


def rank_pieces(sl: Any, full: int, rank: int, world_size: int) -> list[tuple[int, int, int]]:
    """(global start, local start, length) of each run along sl.dim that `rank` holds of a value cut as `sl` (a
    ParamSlice, or a Shard); padding is left out, so the local positions past the last run are the zero padding."""
    return [(a, loc, n) for a, loc, n, _ in dim_layout(sl, full, world_size).runs(rank) if n > 0]


def slice_shape(shape: Sequence[int], sl: Any, world_size: int) -> tuple[int, ...]:
    """A parameter's shape on one rank when cut by ParamSlice `sl` (None: whole)."""
    if sl is None:
        return tuple(shape)
    out = list(shape)
    out[sl.dim] = dim_layout(sl, shape[sl.dim], world_size).local_size(0)
    return tuple(out)


def segment_ranges(size: int, segments: Optional[Sequence[int]], rank: int, world_size: int,
                   cuts: Optional[Cuts] = None) -> list[tuple[int, int]]:
    """The [start, stop) index ranges along a sharded dim that `rank` holds, in its padded positions (a segment of
    g < world_size pieces: piece rank // (world_size / g) of it, shared with the other ranks of that group)."""
    cut = ParamSlice(0, tuple(segments) if segments else None, cuts=cuts)
    return dim_layout(cut, size, world_size).blocks(rank)


def slice_placement(sl: ParamSlice) -> Shard:
    """The placement of a parameter cut by `sl`, as its readers see it."""
    if sl.cuts is not None:
        return Shard(sl.dim, sl.segments, cuts=sl.cuts)
    return Shard(sl.dim, sl.segments if sl.segments and len(sl.segments) > 1 else None)


def local_shape(shape: Sequence[Any], p: Any, rank: int, world_size: int) -> tuple:
    """The shape rank `rank` holds of a value of global `shape` placed as `p` (sizes may be symbolic)."""
    out = list(shape)
    if not isinstance(p, Shard) or p.dim >= len(out):
        return tuple(out)
    size = out[p.dim]
    if p.pieces:
        out[p.dim] = size // p.pieces
        if p.within is not None and p.dim + 1 < len(out):  # the rank's piece of the next dim, zeros included
            out[p.dim + 1] = dim_layout(p, None, world_size).within_run(rank)[1]
    elif p.cuts is not None:  # `outer` repetitions of padded heads (batch x heads), or the cut dim once
        out[p.dim] = dim_layout(p, None, world_size).local_extent(rank)
    elif p.segments and isinstance(size, int):
        out[p.dim] = dim_layout(p, size, world_size).local_size(rank)
    elif p.seq:  # this rank's share of every sequence's tokens (`outer` sequences flattened with them), k entries each
        tokens, k = token_shares.tokens_of(block_of(size, p.outer))
        out[p.dim] = token_shares.share(tokens, rank, world_size) * k * (1 if p.outer is None else p.outer)
    else:
        out[p.dim] = size // world_size
    return tuple(out)


def shape_key(shape: Sequence[Any]) -> tuple[str, ...]:
    """A shape as expressions ('s0', 's1//2', '64'), so symbolic sizes compare as expressions."""
    return tuple(str(s) for s in shape)
