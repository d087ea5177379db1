"""Verify pass: slices tile every parameter in bounds; every rank graph lints and issues the same collectives.

Everything here reads what the other passes wrote (placements, slices, the collective nodes'
`tp_shape`), so it costs a walk over each graph and no tensor work. A violation is a compiler
bug, never a user error, so the messages name the node or parameter and ask for a report; the
way around it until then is to replicate the module involved.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch
from torch.fx import Graph, GraphModule, Node

from tpcompile.errors import TPCompileError
from tpcompile.passes.context import PassContext, module_path, owner_path
from tpcompile.placement import Shard, segment_ranges

REPORT = "this is a tpcompile bug; please report it with the model"


def verify_pass(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Check that the ranks' slices of each split parameter lie in bounds and cover it exactly once."""
    for name, sl in ctx.param_slices.items():
        if sl is not None:
            check_tiling(name, tuple(ctx.tensors[name].shape), sl, ctx.world_size)
    return gm


def check_tiling(name: str, shape: tuple, sl: Any, world_size: int) -> None:
    """Raise unless the pieces of `name` along sl.dim are in bounds, disjoint, and cover it."""
    way_out = f"{REPORT}; plan={{{owner_path(name)!r}: 'replicate'}} avoids it"
    if not 0 <= sl.dim < len(shape):
        raise TPCompileError(f"parameter {name} of shape {list(shape)} is split on dim {sl.dim}, which it "
                             f"does not have; {way_out}")
    size = shape[sl.dim]
    full = sl.padded or size
    if full < size or (sl.segments and sum(sl.segments) != full):
        raise TPCompileError(f"parameter {name}: split size {full} (segments {sl.segments}) does not match its "
                             f"dim {sl.dim} of size {size}; {way_out}")
    pieces = sl.groups or world_size
    if world_size % pieces or any(s % pieces for s in (sl.segments or (full,))):
        raise TPCompileError(f"parameter {name}: dim {sl.dim} of size {full} (segments {sl.segments}) cannot be "
                             f"cut into {pieces} equal pieces for world size {world_size}; {way_out}")
    covered = sorted(r for rank in range(pieces) for r in segment_ranges(full, sl.segments, rank, pieces))
    pos = 0
    for a, b in covered:
        if a != pos or b > full:
            what = "leave a gap" if a > pos else "overlap" if a < pos else "run out of bounds"
            raise TPCompileError(f"slices of parameter {name} along dim {sl.dim} {what} at index {min(a, pos)} "
                                 f"(pieces {covered}, size {full}); {way_out}")
        pos = b
    if pos != full:
        raise TPCompileError(f"slices of parameter {name} cover {pos} of {full} along dim {sl.dim}; {way_out}")


def local_shape(shape: Sequence[Any], p: Any, rank: int, world_size: int) -> tuple:
    """The shape rank `rank` holds of a value of global `shape` placed as `p` (sizes may be symbolic)."""
    out = list(shape)
    if not isinstance(p, Shard) or p.dim >= len(out):
        return tuple(out)
    size = out[p.dim]
    if p.groups:
        out[p.dim] = size // p.groups
        if p.split_next and p.dim + 1 < len(out):
            out[p.dim + 1] = out[p.dim + 1] // p.split_next
    elif p.padded:
        out[p.dim] = p.padded // world_size
    elif p.segments and isinstance(size, int):
        out[p.dim] = sum(b - a for a, b in segment_ranges(size, p.segments, rank, world_size))
    else:
        out[p.dim] = size // world_size
    return tuple(out)


def shape_key(shape: Sequence[Any]) -> tuple[str, ...]:
    """A shape as expressions ('s0', 's1//2', '64'), so symbolic sizes compare as expressions."""
    return tuple(str(s) for s in shape)


def is_collective(n: Node) -> bool:
    """A call of one of tpcompile's collectives (torch.ops.tpcompile.*)."""
    return n.op == "call_function" and getattr(n.target, "namespace", None) == "tpcompile"


def collective_signature(gm: Union[GraphModule, Graph]) -> list[tuple]:
    """Per collective in graph order: (op, non-tensor args, input shape as expressions, node)."""
    sig = []
    for n in (gm.graph if isinstance(gm, GraphModule) else gm).nodes:
        if is_collective(n):
            args = tuple(a for a in n.args[1:] if not isinstance(a, Node))
            sig.append((n.target.name(), args, n.meta.get("tp_shape"), n))
    return sig


def _where(n: Optional[Node]) -> str:
    if n is None:
        return "nothing (the graph ends)"
    return f"{n.format_node()} at {module_path(n) or 'the top-level module'}"


def verify_rank(rank_gm: GraphModule, reference: list[tuple], rank: int,
                param_shapes: Optional[dict[str, tuple]] = None) -> None:
    """A rank graph lints, holds parameters of the planned shapes, and issues rank 0's collectives."""
    try:
        rank_gm.graph.lint()
    except Exception as e:  # lint raises RuntimeError/AssertionError naming the node
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__  # lint appends the whole graph
        raise TPCompileError(f"rank {rank}'s graph is malformed: {first}; {REPORT}") from e
    if param_shapes:
        _check_params(rank_gm, rank, param_shapes)
    sig = collective_signature(rank_gm)
    for k in range(max(len(sig), len(reference))):
        mine = sig[k] if k < len(sig) else None
        ref = reference[k] if k < len(reference) else None
        if mine is not None and ref is not None and mine[:3] == ref[:3]:
            continue
        raise TPCompileError(
            f"collective #{k} differs between ranks: rank {rank} issues "
            f"{_describe(mine)}, rank 0 issues {_describe(ref)}; the ranks would deadlock or exchange "
            f"mismatched tensors. {REPORT}; replicating the module named with plan={{'path': 'replicate'}} "
            f"avoids it")


def _describe(entry: Optional[tuple]) -> str:
    if entry is None:
        return "nothing (its graph has no more collectives)"
    op, args, shape, node = entry
    return f"{op}{args} on a tensor of shape {list(shape) if shape else '?'} ({_where(node)})"


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
