"""Projections whose heads meet in one attention are cut alike: runs of heads found on one of them given to all.

An attention pairs query head j with key and value head j, so a split keeps them together only if the query, key
and value projections are cut the same way. Annotate finds a projection's segments from what is done to its own
output: DiffLlama chunks its value heads into two halves and repeats each half for every query head
(`v.chunk(2, dim=1)`, `.repeat(1, 2, 1, 1)`), so the value projection is two runs of heads, each split among the
ranks (rank r holds its block of each half; the repeat tiles them). Its query and key projections, read whole by
the two attentions, would be split as one run, and rank r's query heads would not be those its value heads serve.
This pass gives the query and key projections the value's runs (and head sizes) where they have none of their own
and the same width, so that each rank holds its block of each half of every projection.
"""
from __future__ import annotations

from typing import Optional

from torch.fx import GraphModule, Node

from tpcompile.passes.feature_walk import last_dim
from tpcompile.passes.head_projections import SDPA, projection
from tpcompile.passes.pass_context import PassContext
from tpcompile.sharding_rules import RuleSpec


def align_head_runs(gm: GraphModule, ctx: PassContext) -> None:
    """Give the projections an attention reads without segments the runs of heads of the one that has them."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in SDPA or len(node.args) < 3:
            continue
        found = [projection(a, ctx) for a in node.args[:3]]
        if any(f is None for f in found) or len({id(f) for f in found}) < 3:
            continue  # one fused q|k|v projection cuts its own segments
        runs = {_runs(f) for f in found} - {None}
        sizes = {d for f in found for d in f.meta["tp_rule"].get("heads") or () if d}  # the head size
        if len(runs) != 1 or len({last_dim(f) for f in found}) != 1 or len(sizes) != 1:
            continue
        segments, d = next(iter(runs)), next(iter(sizes))
        if any(s % d for s in segments):
            continue
        heads = (d,) * len(segments)
        if any(f.meta["tp_rule"].get("segments") not in (None, segments) for f in found):
            continue
        for f in found:  # whole heads a rank in each run: zero-padded to one a rank when fewer (`unit`)
            spec = f.meta["tp_rule"]
            f.meta["tp_rule"] = RuleSpec(spec.rule, {**spec.args, "segments": segments, "heads": heads,
                                                     "unit": heads})


def _runs(node: Node) -> Optional[tuple[int, ...]]:
    """The segments of a projection cut into equal runs, else None."""
    segments = node.meta["tp_rule"].get("segments")
    return tuple(segments) if segments and len(segments) > 1 and len(set(segments)) == 1 else None
