"""One split dim as data: a sequence of segments, each cut into pieces with explicit extents, bound to ranks.

A fused q|k|v projection is three segments; a zero-padded vocabulary one segment whose cuts run past its
size (the zeros); kv heads fewer than ranks a segment of fewer pieces than ranks, piece k held by the ranks
k * h ... (k + 1) * h - 1, h = ceil(world_size / pieces) (`holders`: 2 kv heads at 5 ranks are held by ranks
0-2 and 3-4); heads folded with the batch the segments repeated (`repeat`, a count often known only at run
time); grouped query heads cut among the ranks sharing a kv head the next dim's own cut (`within`). The
placement fields (`segments`, their `cuts`, `outer` and `within`) are read in one place, `dim_layout`; the
arithmetic on what a rank holds (`DimLayout.runs`, `DimLayout.local_size`, `DimLayout.local_extent`,
`DimLayout.within_run`) is done once, here, on this value.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import sympy

from tpcompile.layouts import token_shares


@dataclass(frozen=True)
class Segment:
    """`size` real elements; piece k is [cuts[k], cuts[k + 1]) of the segment padded with zeros to cuts[-1]."""

    size: int
    cuts: tuple[int, ...]

    @property
    def pieces(self) -> int:
        return len(self.cuts) - 1


@dataclass(frozen=True)
class DimLayout:
    """The segments of one dim, in order, and the world size their pieces are bound to: the dim is `repeat`
    repetitions of them (one: the segments are the dim; more: batch x heads, each repetition cut alike), and
    `within`, when set, cuts the next dim among the ranks holding each piece (the i-th of them holding its piece
    i). `runs`, `blocks`, `owned` and `local_size` are of one repetition; `local_extent` of the whole dim."""

    world_size: int
    segments: tuple[Segment, ...]
    repeat: Any = 1
    within: Optional[Segment] = None

    @property
    def block(self) -> Any:
        """One repetition's size: the segments' real elements."""
        return sum(seg.size for seg in self.segments)

    def piece(self, seg: Segment, rank: int) -> int:
        """The piece of `seg` that `rank` holds."""
        return rank // holders(self.world_size, seg.pieces)

    def blocks(self, rank: int) -> list[tuple[int, int]]:
        """Per segment, the [start, stop) that `rank` holds in the dim's padded positions (each segment's
        start offset by the padded sizes before it)."""
        out, offset = [], 0
        for seg in self.segments:
            k = self.piece(seg, rank)
            out.append((offset + seg.cuts[k], offset + seg.cuts[k + 1]))
            offset += seg.cuts[-1]
        return out

    def runs(self, rank: int) -> list[tuple[int, int, int, int]]:
        """Per segment, (global start, local start, length of real data, local block) of what `rank` holds; global
        positions count real elements only (the padding of a segment is not part of the tensor)."""
        out, offset, local = [], 0, 0
        for seg in self.segments:
            k = self.piece(seg, rank)
            a, b = seg.cuts[k], seg.cuts[k + 1]
            start = min(a, seg.size)
            out.append((offset + start, local, max(0, min(b, seg.size) - start), b - a))
            offset, local = offset + seg.size, local + b - a
        return out

    def owned(self, rank: int) -> list[tuple[int, int, int]]:
        """(global start, local start, real length) of the runs `rank` counts: of each piece it holds, only those it
        is the first of its ranks to hold, so that the ranks together count every real element once (a norm)."""
        return [(a, loc, n) for seg, (a, loc, n, _) in zip(self.segments, self.runs(rank))
                if n > 0 and rank % holders(self.world_size, seg.pieces) == 0]

    @property
    def distinct(self) -> bool:
        """True when every piece is held by one rank only (no piece shared by several ranks)."""
        return all(seg.pieces == self.world_size for seg in self.segments)

    def local_size(self, rank: int) -> int:
        """One repetition's size on `rank`, its zero padding included (the dim's, unrepeated)."""
        return sum(seg.cuts[self.piece(seg, rank) + 1] - seg.cuts[self.piece(seg, rank)] for seg in self.segments)

    def local_extent(self, rank: int) -> Any:
        """The dim's size on `rank`: `repeat` times one repetition's (possibly a run-time size)."""
        local = self.local_size(rank)
        return local if self.repeat == 1 else self.repeat * local

    def within_run(self, rank: int) -> tuple[int, int]:
        """(start, size) of the next dim's piece that `rank` holds (`within`), zero padding included: the i-th rank
        of its piece's run holds piece i."""
        assert self.within is not None, "the next dim is not cut within the pieces"
        i = rank % holders(self.world_size, self.segments[0].pieces)
        return self.within.cuts[i], self.within.cuts[i + 1] - self.within.cuts[i]

    def spelled(self) -> Optional[DimLayout]:
        """The same holdings with the repetitions spelled out as segments (a known count), else None."""
        if not isinstance(self.repeat, int) or self.within is not None:
            return None
        return DimLayout(self.world_size, self.segments * self.repeat)


def holders(world_size: int, pieces: int) -> int:
    """How many ranks hold each of `pieces` pieces: ceil(world_size / pieces), piece k held by the ranks
    k * h ... (k + 1) * h - 1 (the last piece by fewer when the pieces do not divide the ranks)."""
    return -(-world_size // pieces)


def holder_runs(world_size: int, pieces: int) -> list[range]:
    """The ranks holding each of `pieces` pieces (`holders`): 2 pieces at 5 ranks, ranks 0-2 and 3-4."""
    h = holders(world_size, pieces)
    return [range(k * h, min((k + 1) * h, world_size)) for k in range(pieces)]


def binds(world_size: int, pieces: int) -> bool:
    """True when `pieces` pieces bound to ranks by `holders` give every piece at least one rank."""
    return 0 < pieces <= world_size and (pieces - 1) * holders(world_size, pieces) < world_size


def even_cuts(total: int, pieces: int) -> tuple[int, ...]:
    """`total` cut into `pieces` equal pieces."""
    assert total % pieces == 0, f"segment {total} not divisible into {pieces} pieces"
    step = total // pieces
    return tuple(i * step for i in range(pieces + 1))


def within_cut(size: int, ways: int, per: Optional[int] = None) -> Segment:
    """A next dim of `size` cut `ways` ways among the ranks holding each piece of a split dim (`Shard.within`, the
    i-th of them holding piece i): evenly, or `per` each, zero-padded past `size` (a group the sharing ranks do not
    divide)."""
    per = size // ways if per is None else per
    return Segment(int(size), tuple(i * per for i in range(ways + 1)))


def is_even(cuts: Sequence[int]) -> bool:
    """True when the pieces of these bounds are all one size."""
    step = cuts[1] - cuts[0] if len(cuts) > 1 else 0
    return all(b - a == step for a, b in zip(cuts, cuts[1:]))


def block_of(size: Any, repeat: Any) -> Any:
    """One of `repeat` repetitions of a dim of `size` (None or 1: the dim): an int when the quotient is a number."""
    if repeat is None or repeat == 1:
        return size
    if isinstance(size, int) and isinstance(repeat, int):
        assert size % repeat == 0, f"a dim of {size} is not {repeat} repetitions of one block"
        return size // repeat
    block = sympy.simplify(sympy.sympify(size) / sympy.sympify(repeat))
    return int(block) if block.is_Integer else block


def dim_layout(p: Any, full: Optional[Any], world_size: int, repeat: Any = None) -> DimLayout:
    """The layout of a split dim of size `full` (None: not known, a padded split's padding gives the sizes) that a
    ParamSlice or Shard `p` describes (its `segments` and their `cuts`, pieces included, the cuts of a padded dim, or a
    token split's shares; a Shard's `outer` repetitions of them, `full` counting every repetition, and the next dim's
    cut `within` its pieces). `repeat`: the value of a run-time `outer` where it is known (a checker's example)."""
    repeat, within = repeat or getattr(p, "outer", None) or 1, getattr(p, "within", None)
    inner = _segments(p, None if full is None else block_of(full, repeat), world_size)
    return inner if repeat == 1 and within is None else DimLayout(world_size, inner.segments, repeat, within)


def _segments(p: Any, full: Optional[int], world_size: int) -> DimLayout:
    """One repetition of `p`'s layout, of size `full`."""
    if p.pieces and full is not None and getattr(p, "seq", False):  # pieces of tokens: a token split's shares
        return _tokens(full, world_size)
    if p.cuts is not None:  # explicit: segment k cut at p.cuts[k]; without segments, the dim cut past its size
        assert all(binds(world_size, len(c) - 1) for c in p.cuts), \
            f"pieces {[len(c) - 1 for c in p.cuts]} leave a piece without a rank at world size {world_size}"
        segs = p.segments or (p.cuts[0][-1] if full is None else full,)
        return DimLayout(world_size, tuple(Segment(s, tuple(c)) for s, c in zip(segs, p.cuts)))
    if getattr(p, "seq", False) and full is not None:
        return _tokens(full, world_size)
    segs = list(p.segments) if p.segments else [full]
    assert full is None or sum(segs) == full, f"segments {segs} do not add up to {full}"
    return DimLayout(world_size, tuple(Segment(s, even_cuts(s, world_size)) for s in segs))


def _tokens(full: int, world_size: int) -> DimLayout:
    """A token split: one run a rank, the first full % ws one longer."""
    bounds = tuple(token_shares.start(full, r, world_size) for r in range(world_size)) + (full,)
    return DimLayout(world_size, (Segment(full, bounds),))


def same_holdings(p: Any, q: Any, full: Any, world_size: int) -> bool:
    """True when splits `p` and `q` of one dim of size `full` give every rank the same elements in the same local
    order, however each is written: `outer` repetitions of a split (a reshape's batch x heads) are as many segments
    cut alike (a repeat's copies)."""
    a, b = _holdings(p, full, world_size), _holdings(q, full, world_size)
    return a is not None and a == b


def _holdings(p: Any, full: Any, world_size: int) -> Optional[DimLayout]:
    """p's layout of a dim of `full` elements with its outer repetitions spelled out; None when p does not lay out
    such a dim (a size the ranks do not divide, pieces, tokens)."""
    if not isinstance(full, int) or p.pieces is not None or getattr(p, "within", None) is not None or p.seq:
        return None
    outer = p.outer or 1
    if not isinstance(outer, int) or (outer > 1 and p.segments is not None) or full % outer:
        return None
    segs = p.segments or (full // outer,)
    if p.cuts is None and any(s % world_size for s in segs) or sum(segs) != full // outer:
        return None
    return dim_layout(p, full, world_size).spelled()
