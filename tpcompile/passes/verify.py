"""Verify pass: slices tile every parameter; every rank issues the same collectives."""
from __future__ import annotations

from torch.fx import GraphModule

from tpcompile.passes.context import PassContext
from tpcompile.placement import segment_ranges


def verify_pass(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Check that the ranks' slices of each split parameter cover it exactly once."""
    for name, sl in ctx.param_slices.items():
        if sl is None:
            continue
        size = sl.padded or ctx.tensors[name].shape[sl.dim]
        pieces = sl.groups or ctx.world_size
        covered = sorted(r for rank in range(pieces) for r in segment_ranges(size, sl.segments, rank, pieces))
        pos = 0
        for a, b in covered:
            assert a == pos, f"slices of {name} along dim {sl.dim} leave a gap or overlap at {pos}"
            pos = b
        assert pos == size, f"slices of {name} cover {pos} of {size} along dim {sl.dim}"
    return gm


def collective_signature(gm: GraphModule) -> list[tuple]:
    """The ordered (op, args without tensors) of every collective in a rank graph."""
    sig = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and getattr(n.target, "namespace", None) == "tpcompile":
            sig.append((n.target.name(), tuple(a for a in n.args[1:])))
    return sig


def verify_rank(rank_gm: GraphModule, reference: list[tuple], rank: int) -> None:
    """A rank graph is well formed and issues the same collectives as rank 0."""
    rank_gm.graph.lint()
    sig = collective_signature(rank_gm)
    assert sig == reference, f"rank {rank} issues collectives {sig}, rank 0 issues {reference}"
