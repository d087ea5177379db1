"""Verify pass (after propagate): the ranks' slices of every split parameter lie in bounds and tile it,
and every read of a split parameter is one planned for the split.

It reads only what propagate decided (the frozen plan, passes/decisions.py), so it costs a
walk over the parameters and their readers and no tensor work. A violation is a compiler bug, never a user error, so the
messages name the parameter and ask for a report; the way around it until then is to
replicate the module involved. The rank graphs are checked by verify_ranks.py.
"""
from __future__ import annotations

from typing import Any

from torch.fx import GraphModule, Node

from tpcompile.errors import TPCompileError
from tpcompile.passes.decisions import Decisions
from tpcompile.passes.pass_context import describe, owner_path
from tpcompile.layouts import binds, dim_layout
from tpcompile.placement import segment_ranges, slice_placement

REPORT = "this is a tpcompile bug; please report it with the model"


def verify_pass(gm: GraphModule, decided: Decisions) -> GraphModule:
    """Check that the ranks' slices of each split parameter tile it, and that every read of it is planned."""
    for name, sl in decided.cuts.items():
        if sl is not None:
            check_tiling(name, tuple(decided.tensors[name].shape), sl, decided.world_size)
    for node in gm.graph.nodes:
        if node.op == "get_attr" and decided.slice_for(node.target) is not None:
            check_reads(node, decided)
    return gm


def check_reads(param: Node, decided: Decisions) -> None:
    """Every reader of a split parameter is a weight op that cut it, or an op planned for the split value.

    A reader that would see the rank's slice while expecting the whole parameter (a tied head
    written `h @ W.t()`, a norm of the weight, the weight returned) is a wrong result on every
    rank; propagation places or replicates such reads, and this proves it did.
    """
    sl = decided.slice_for(param.target)
    split = slice_placement(sl)
    seeds = frozenset().union(*(decided.seeds.get(n, frozenset()) for n in decided.aliases(param.target)))
    for user in param.users:
        layout = decided.layout(user)
        if user in seeds or layout is None:
            continue
        if user.op == "output" and split.plain:  # gathered, or kept split as the plan asks
            continue
        if any(w.node is param and w.placement == split for w in layout.wants):
            continue
        cut = f"split on dim {sl.dim}" + (f" into {sl.pieces} pieces" if sl.pieces else "")
        raise TPCompileError(
            f"parameter {param.target} is {cut} for {', '.join(sorted(describe(s) for s in seeds)) or 'its weight op'}, "
            f"but {describe(user)} reads it without planning for the split, so each rank would compute with its "
            f"slice as if it were the whole parameter. {REPORT}; plan={{{owner_path(param.target)!r}: 'replicate'}} "
            f"avoids it")


def check_tiling(name: str, shape: tuple, sl: Any, world_size: int) -> None:
    """Raise unless the pieces of `name` along sl.dim are in bounds, disjoint, and cover it."""
    way_out = f"{REPORT}; plan={{{owner_path(name)!r}: 'replicate'}} avoids it"
    if not 0 <= sl.dim < len(shape):
        raise TPCompileError(f"parameter {name} of shape {list(shape)} is split on dim {sl.dim}, which it "
                             f"does not have; {way_out}")
    size = shape[sl.dim]
    if sl.cuts is not None and sl.segments is not None:  # each segment cut at its own bounds
        return _check_cuts(name, size, sl, world_size, way_out)
    if sl.cuts is not None and (len(sl.cuts) != 1 or sl.cuts[0][-1] % world_size or tuple(sl.cuts[0]) != tuple(
            i * (sl.cuts[0][-1] // world_size) for i in range(world_size + 1))):  # a padded split: one even cut a rank
        raise TPCompileError(f"parameter {name}: cuts {sl.cuts} of its whole dim {sl.dim} are not one even piece a "
                             f"rank at world size {world_size}; {way_out}")
    full = sl.padded or size
    if full < size or (sl.segments and sum(sl.segments) != full):
        raise TPCompileError(f"parameter {name}: split size {full} (segments {sl.segments}) does not match its "
                             f"dim {sl.dim} of size {size}; {way_out}")
    if any(s % world_size for s in sl.segments or (full,)):
        raise TPCompileError(f"parameter {name}: dim {sl.dim} of size {full} (segments {sl.segments}) cannot be "
                             f"cut into {world_size} equal pieces for world size {world_size}; {way_out}")
    covered = sorted(r for rank in range(world_size) for r in segment_ranges(full, sl.segments, rank, world_size))
    pos = 0
    for a, b in covered:
        if a != pos or b > full:
            what = "leave a gap" if a > pos else "overlap" if a < pos else "run out of bounds"
            raise TPCompileError(f"slices of parameter {name} along dim {sl.dim} {what} at index {min(a, pos)} "
                                 f"(pieces {covered}, size {full}); {way_out}")
        pos = b
    if pos != full:
        raise TPCompileError(f"slices of parameter {name} cover {pos} of {full} along dim {sl.dim}; {way_out}")


def _check_cuts(name: str, size: int, sl: Any, world_size: int, way_out: str) -> None:
    """Raise unless each segment's bounds are in order and hold it, every piece has a rank, every rank
    holds as much, and the ranks' real runs (a piece several ranks share counted once) tile the dim."""
    segs, cuts = tuple(sl.segments or ()), tuple(sl.cuts)
    if len(segs) != len(cuts) or sum(segs) != size or any(
            len(c) < 2 or not binds(world_size, len(c) - 1) or c[0] != 0 or c[-1] < s or list(c) != sorted(c)
            for s, c in zip(segs, cuts)):
        raise TPCompileError(f"parameter {name}: cuts {cuts} do not fit segments {segs} of dim {sl.dim} (size "
                             f"{size}) at world size {world_size}; {way_out}")
    layout = dim_layout(sl, size, world_size)
    if len({layout.local_size(r) for r in range(world_size)}) != 1:
        raise TPCompileError(f"parameter {name}: cuts {cuts} give the ranks different sizes; {way_out}")
    _check_cover(name, sl.dim, size, sorted({(a, a + n) for r in range(world_size)
                                             for a, _, n, _ in layout.runs(r) if n > 0}), way_out)


def _check_cover(name: str, dim: int, size: int, runs: list, way_out: str) -> None:
    """Raise unless the sorted [start, stop) runs tile [0, size) exactly once."""
    pos = 0
    for a, b in runs:
        if a != pos:
            raise TPCompileError(f"slices of parameter {name} along dim {dim} leave a gap or overlap at index "
                                 f"{min(a, pos)} (runs {runs}); {way_out}")
        pos = b
    if pos != size:
        raise TPCompileError(f"slices of parameter {name} cover {pos} of {size} along dim {dim}; {way_out}")
