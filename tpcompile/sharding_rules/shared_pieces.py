"""Values in pieces shared by ranks (`placement.piece_shard`: kv heads fewer than the ranks) read and carried across
tensors: the same pieces over a dim of another size, one piece every rank holds whole, and the cuts a rank makes of
its piece locally."""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from tpcompile.placement import Shard, piece_shard


def piece_resized(p: Shard, size: Any, pieces: Optional[int] = None) -> Shard:
    """`p`'s pieces (or `pieces` of them) over a dim of `size` elements: the ranks holding each piece stay, its
    extent follows the tensor (q's heads and k's heads in as many pieces; one piece repeated or moved). A dim
    of a size not known until run time is one piece, whole on every rank."""
    cut = piece_shard(p.dim, size, p.pieces if pieces is None else pieces)
    return replace(p, segments=cut.segments, cuts=cut.cuts)


def whole_piece(p: object, dim: int) -> bool:
    """True for one piece that every rank holds whole on `dim`, nothing else (multi-query's one kv head)."""
    return isinstance(p, Shard) and p.dim == dim and p.pieces == 1 and p.split_next is None and p.outer is None \
        and not p.seq


def same_pieces(p: object, q: object) -> bool:
    """True when `p` and `q` are the same pieces bound to the same ranks, whatever the sizes of their dims (q's heads
    and k's heads, each in 2 pieces); else plain equality."""
    if isinstance(p, Shard) and isinstance(q, Shard) and p.pieces is not None and q.pieces is not None:
        return replace(p, segments=q.segments, cuts=q.cuts) == q and p.pieces == q.pieces
    return p == q


def cut_from_shared(have: object, want: object, world_size: int) -> bool:
    """True when `want` is cut locally from `have`, a value in pieces each shared by several ranks: from one piece
    every rank holds whole (`piece_shard(d, n, 1)`: multi-query's kv head repeated over the query heads), a zero-padded
    split or g pieces of its own; from g pieces the ranks divide (k heads repeated over 4 v heads at 4 ranks), even."""
    if not isinstance(have, Shard) or not isinstance(want, Shard) or want.dim != have.dim or not have.pieces:
        return False
    if have.pieces == 1:  # (pieces of its own: Mamba-2's one group of B repeated for heads fewer than the ranks)
        return want.plain_padded or want.in_pieces and want.pieces > 1
    return want.plain and world_size % have.pieces == 0 and have.split_next is None and have.outer is None \
        and not have.seq
