"""tpcompile.layouts: each layout the placements describe as one value (segments cut into pieces with explicit
extents), what each rank holds of it, and that the ranks' real parts tile the dim."""
from __future__ import annotations

import pytest

from tpcompile.layouts import DimLayout, Segment, dim_layout
from tpcompile.placement import (ParamSlice, Shard, local_shape, pad_cuts, piece_cut, rank_pieces, seg_cuts,
                                 slice_placement, slice_shape)

CASES = {  # name -> (placement, dim size, world size, rank, expected runs, expected local size)
    "fused q|k|v": (ParamSlice(0, (8, 8, 8)), 24, 2, 1, [(4, 0, 4, 4), (12, 4, 4, 4), (20, 8, 4, 4)], 12),
    "padded vocabulary": (ParamSlice(0, cuts=pad_cuts(252, 4)), 250, 4, 3, [(189, 0, 61, 63)], 63),
    "kv heads fewer than ranks": (ParamSlice(0, (8, 2, 2), cuts=seg_cuts((8, 2, 2), 4, counts=(4, 1, 1))), 12, 4, 2,
                                  [(4, 0, 2, 2), (8, 2, 2, 2), (10, 4, 2, 2)], 6),
    "pieces shared by ranks": (piece_cut(0, 8, 2), 8, 4, 3, [(4, 0, 4, 4)], 4),
    "padded segments": (ParamSlice(0, (10, 6), cuts=seg_cuts((10, 6), 4, (12, 8))), 16, 4, 3,
                        [(9, 0, 1, 3), (16, 3, 0, 2)], 5),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_what_a_rank_holds(name: str) -> None:
    sl, full, ws, rank, runs, size = CASES[name]
    layout = dim_layout(sl, full, ws)
    assert layout.runs(rank) == runs
    assert layout.local_size(rank) == size
    assert rank_pieces(sl, full, rank, ws) == [(a, loc, n) for a, loc, n, _ in runs if n > 0]
    assert slice_shape((full, 3), sl, ws) == (size, 3)
    assert local_shape((full, 3), slice_placement(sl), rank, ws) == (size, 3)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_ranks_real_parts_tile_the_dim(name: str) -> None:
    """Each element is held by as many ranks as share its piece (world_size / pieces), at one local position."""
    sl, full, ws, _, _, _ = CASES[name]
    layout = dim_layout(sl, full, ws)
    held: dict[int, int] = {}
    for rank in range(ws):
        for start, _, n, _ in layout.runs(rank):
            for i in range(start, start + n):
                held[i] = held.get(i, 0) + 1
    assert sorted(held) == list(range(full))
    for seg_start, seg in zip([0, *[sum(s.size for s in layout.segments[:k + 1]) for k in range(len(layout.segments))]],
                              layout.segments):
        assert {held[i] for i in range(seg_start, seg_start + seg.size)} == {ws // seg.pieces}


def test_uneven_cuts_are_values_too() -> None:
    """Per-rank extents need not be equal: 5 heads of 4 over 2 ranks as 3|2 heads."""
    layout = DimLayout(2, (Segment(20, (0, 12, 20)),))
    assert [layout.local_size(r) for r in range(2)] == [12, 8]
    assert layout.runs(1) == [(12, 0, 8, 8)]


def test_pieces_the_ranks_do_not_divide_are_held_by_runs_of_ranks() -> None:
    """2 pieces at 5 ranks: ranks 0-2 hold piece 0, ranks 3-4 piece 1; each real element counted once (by the
    first rank holding it)."""
    layout = dim_layout(piece_cut(0, 8, 2), 8, 5)
    assert [layout.blocks(r) for r in range(5)] == [[(0, 4)]] * 3 + [[(4, 8)]] * 2
    assert [layout.owned(r) for r in range(5)] == [[(0, 0, 4)], [], [], [(4, 0, 4)], []]
    assert local_shape((3, 8), Shard(1, pieces=2), 4, 5) == (3, 4)


def test_a_piece_count_must_leave_no_piece_without_a_rank() -> None:
    """3 pieces at 4 ranks: 2 ranks a piece leave the third piece none."""
    with pytest.raises(AssertionError, match="leave a piece without a rank"):
        dim_layout(ParamSlice(0, (6, 3), cuts=seg_cuts((6, 3), 4, counts=(3, 3))), 9, 4)
