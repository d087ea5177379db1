"""tpcompile.layouts: each layout the placements describe as one value (segments cut into pieces with explicit
extents), what each rank holds of it, and that the ranks' real parts tile the dim."""
from __future__ import annotations

import pytest
import sympy

from tpcompile.layouts import DimLayout, Segment, block_of, dim_layout, within_cut
from tpcompile.placement import (ParamSlice, Shard, local_shape, pad_cuts, piece_cut, piece_shard, rank_pieces,
                                 seg_cuts, slice_placement, slice_shape)

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
    assert local_shape((3, 8), piece_shard(1, 8, 2), 4, 5) == (3, 4)


def test_a_piece_count_must_leave_no_piece_without_a_rank() -> None:
    """3 pieces at 4 ranks: 2 ranks a piece leave the third piece none."""
    with pytest.raises(AssertionError, match="leave a piece without a rank"):
        dim_layout(ParamSlice(0, (6, 3), cuts=seg_cuts((6, 3), 4, counts=(3, 3))), 9, 4)


def test_a_value_in_pieces_is_a_cut_with_extents() -> None:
    """A value in pieces is one segment cut into equal pieces (the cut a parameter in pieces has): its count is read
    from the cuts, it prints as before, and the same pieces over a dim of another size are another value."""
    from tpcompile.placement import param_cut
    from tpcompile.sharding_rules.shared_pieces import piece_resized, same_pieces, whole_piece
    p = piece_shard(1, 8, 2)
    assert (p.segments, p.cuts, p.pieces, str(p)) == ((8,), ((0, 4, 8),), 2, "S(1/2)")
    assert p.in_pieces and not p.plain and p.padded is None and not p.rank_cuts
    assert param_cut(p, 8) == piece_cut(1, 8, 2) and slice_placement(piece_cut(1, 8, 2)) == p
    assert [local_shape((3, 8), p, r, 4) for r in range(4)] == [(3, 4)] * 4
    k = piece_resized(p, 2)  # k's 2 heads in the query's 2 pieces
    assert k != p and same_pieces(k, p) and k.cuts == ((0, 1, 2),)
    assert not same_pieces(piece_shard(1, 8, 4), p) and not same_pieces(Shard(1), p)
    one = piece_shard(1, 1, 1)  # one kv head every rank holds whole
    assert whole_piece(one, 1) and str(one) == "S(1/1)" and piece_resized(one, 4).cuts == ((0, 4),)
    assert not whole_piece(piece_shard(1, 1, 1, seq=True), 1) and not whole_piece(p, 1)
    assert str(piece_shard(0, 4, 2, outer=3, within=within_cut(6, 2))) == "S(0x3/2+2)"


def test_a_rules_pieces_take_the_extents_of_the_tensor_they_are_for() -> None:
    """`conformed`: pieces a rule carries to a tensor whose dim is another size (attention asking k, 2 heads, for the
    query's pieces of 8) take that tensor's size; other placements are kept as they are."""
    import torch
    from torch.fx import Graph

    from tpcompile.placement import REPLICATE
    from tpcompile.sharding_rules.conform import conformed
    from tpcompile.sharding_rules.shared_pieces import piece_resized
    from tpcompile.sharding_rules.rule_context import Result, Want
    g = Graph()
    q, k = g.placeholder("q"), g.placeholder("k")
    out = g.call_function(torch.add, (q, k))
    for n, shape in ((q, (2, 8, 5)), (k, (2, 2, 5)), (out, (2, 8, 5))):
        n.meta["val"] = torch.empty(shape)
    p = piece_shard(1, 8, 2)
    res = conformed(out, Result(p, [Want(q, p), Want(k, p, grad_sync=True)]))
    assert res.out is p and res.wants[0].placement is p
    assert res.wants[1] == Want(k, piece_resized(p, 2), grad_sync=True)
    kept = Result(Shard(1), [Want(k, REPLICATE)])
    assert conformed(out, kept) is kept
    folded = piece_shard(0, 2, 2, outer=4)  # (B*kv, ...) of a batch of 4: the extents are a repetition's
    rows = g.call_function(torch.neg, (q,))
    rows.meta["val"] = torch.empty(16, 5)
    assert conformed(rows, Result(folded, [])).out == piece_shard(0, 4, 2, outer=4)
    rows.meta["val"] = torch.empty(12, 5)  # 3 a repetition: not 2 equal pieces, left as the rule gave it
    assert conformed(rows, Result(folded, [])).out is folded


def test_the_next_dim_cut_within_pieces_is_a_segment() -> None:
    """kv heads in 2 pieces at 5 ranks (ranks 0-2 and 3-4), each kv head's group of 3 query heads cut among its
    ranks: 2 a rank, zero-padded (`within`, read as split_next 3). Every rank's shape carries the padded piece, and
    merged into one heads dim the cut is the group cut of the heads (ranks 0-2: 2 | 1 | 0 real heads of group 0)."""
    from tpcompile.sharding_rules.group_cuts import group_cuts, padded_groups

    p = piece_shard(1, 2, 2, within=within_cut(3, 3, per=2))
    assert p.split_next == 3 and str(p) == "S(1/2+3)" and p.within == Segment(3, (0, 2, 4, 6))
    assert [local_shape((4, 2, 3, 7), p, r, 5) for r in range(5)] == [(4, 1, 2, 7)] * 5
    merged = padded_groups(p, (4, 2, 3, 7), 5)
    assert merged.cuts == group_cuts(2, 3, 1, 3, 5) == ((0, 2, 4, 6, 6, 6), (0, 0, 0, 0, 2, 4))
    assert [rank_pieces(merged, 6, r, 5) for r in range(5)] == [[(0, 0, 2)], [(2, 0, 1)], [], [(3, 0, 2)], [(5, 0, 1)]]
    even = piece_shard(1, 2, 2, within=within_cut(4, 2))  # 4 query heads a group at 4 ranks: 2 a rank, no padding
    assert even.within.cuts == (0, 2, 4) and padded_groups(even, (4, 2, 4, 7), 4) is None


def test_repetitions_and_the_next_dims_cut_are_part_of_the_value() -> None:
    """A dim of batch x heads (`outer`, a run-time size) is the heads' layout repeated: the layout of one block, the
    count, and the dim's size on a rank; with a known count, the repetitions spelled out as segments hold the same;
    the next dim's cut within the pieces is the value's too, the i-th rank of each piece's run holding piece i."""
    b = sympy.Symbol("s0", positive=True, integer=True)
    p = Shard(0, cuts=pad_cuts(8, 4), outer=b)  # 5 heads zero-padded to 8 at 4 ranks, in each of b blocks
    layout = dim_layout(p, 5 * b, 4)
    assert layout.repeat == b and layout.block == 5 and layout.segments == (Segment(5, (0, 2, 4, 6, 8)),)
    assert [n for _, _, n, _ in layout.runs(3)] == [0] and layout.local_size(3) == 2
    assert [layout.local_extent(r) for r in range(4)] == [2 * b] * 4
    assert local_shape((5 * b, 7), p, 3, 4) == (2 * b, 7)
    assert block_of(4 * b, b) == 4 and block_of(12, 3) == 4 and block_of(4 * b, None) == 4 * b
    with pytest.raises(AssertionError, match="not 5 repetitions"):
        block_of(12, 5)
    known = dim_layout(Shard(0, outer=3), 12, 2)  # 3 blocks of 4 split at 2 ranks: 3 segments of 4 alike
    assert known.spelled() == dim_layout(ParamSlice(0, (4, 4, 4)), 12, 2)
    assert [known.local_extent(r) for r in range(2)] == [6, 6]
    pieces = dim_layout(piece_shard(1, 2, 2, within=within_cut(3, 3, per=2)), None, 5)
    assert [pieces.within_run(r) for r in range(5)] == [(0, 2), (2, 2), (4, 2), (0, 2), (2, 2)]
    assert pieces.spelled() is None and dim_layout(piece_cut(0, 8, 2), 8, 4).repeat == 1
