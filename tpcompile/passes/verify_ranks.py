"""Verify each rank graph as it is built: it lints, holds the planned parameter shapes, and issues rank 0's collectives.

Everything here reads what the rewriter wrote (the collective nodes' `tp_shape`), so it costs a
walk over each graph and no tensor work. A violation is a compiler bug, never a user error.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx import GraphModule, Node

from tpcompile.errors import TPCompileError
from tpcompile.ops.schedule import CollectiveCall, graph_schedule
from tpcompile.passes.pass_context import module_path, owner_path
from tpcompile.passes.verify_plan import REPORT


def _where(n: Optional[Node]) -> str:
    if n is None:
        return "nothing (the graph ends)"
    return f"{n.format_node()} at {module_path(n) or 'the top-level module'}"


def verify_rank(rank_gm: GraphModule, reference: list[tuple[CollectiveCall, Node]], rank: int,
                param_shapes: Optional[dict[str, tuple]] = None) -> None:
    """A rank graph lints, holds parameters of the planned shapes, and issues rank 0's collectives."""
    try:
        rank_gm.graph.lint()
    except Exception as e:  # lint raises RuntimeError/AssertionError naming the node
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__  # lint appends the whole graph
        raise TPCompileError(f"rank {rank}'s graph is malformed: {first}; {REPORT}") from e
    if param_shapes:
        _check_params(rank_gm, rank, param_shapes)
    sig = graph_schedule(rank_gm)
    for k in range(max(len(sig), len(reference))):
        mine = sig[k] if k < len(sig) else None
        ref = reference[k] if k < len(reference) else None
        if mine is not None and ref is not None and mine[0] == ref[0]:
            continue
        raise TPCompileError(
            f"collective #{k} differs between ranks: rank {rank} issues "
            f"{_describe(mine)}, rank 0 issues {_describe(ref)}; the ranks would deadlock or exchange "
            f"mismatched tensors. {REPORT}; replicating the module named with plan={{'path': 'replicate'}} "
            f"avoids it")


def _describe(entry: Optional[tuple[CollectiveCall, Node]]) -> str:
    if entry is None:
        return "nothing (its graph has no more collectives)"
    call, node = entry
    return f"tpcompile::{call.op}{call.args} on a tensor of shape {list(call.shape)} ({_where(node)})"


def _check_params(gm: GraphModule, rank: int, expected: dict[str, tuple]) -> None:
    """Every parameter and buffer the rank holds has the shape the plan gives it."""
    have = dict(gm.named_parameters(remove_duplicate=False))
    have.update(dict(gm.named_buffers(remove_duplicate=False)))
    for name, shape in expected.items():
        t = have.get(name)
        if not isinstance(t, torch.Tensor):
            raise TPCompileError(f"rank {rank} lacks parameter {name}; {REPORT}")
        if tuple(t.shape) != tuple(shape):
            raise TPCompileError(f"rank {rank} holds parameter {name} as shape {list(t.shape)}, the plan says "
                                 f"{list(shape)}; {REPORT}; plan={{{owner_path(name)!r}: 'replicate'}} avoids it")
