"""One forward of the captured graph and of every rank (simulated), recording shapes and collectives."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import GraphModule, Interpreter, Node
from torch.fx._pytree import tree_flatten_spec

from tpcompile.ops.collectives import CollectiveEvent, record
from tpcompile.runtime.simulator import simulate_ranks


@dataclass
class Trace:
    """Per-node output shapes of the captured graph and of each rank, and rank 0's collectives."""

    captured_shapes: dict[str, str]
    rank_shapes: list[dict[str, str]]
    events: list[CollectiveEvent] = field(default_factory=list)  # rank 0, forward, in execution order
    outputs: list[Any] = field(default_factory=list)  # each rank's output


def describe_value(value: Any) -> str:
    """'2x16x64 float32' for a tensor, a comma list for a tuple of tensors, the type name otherwise."""
    if isinstance(value, torch.Tensor):
        dims = "x".join(str(int(s)) for s in value.shape) or "scalar"
        return f"{dims} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return ", ".join(describe_value(v) for v in value)
    if isinstance(value, (int, float, bool)):
        return f"{type(value).__name__} {value}"
    return "" if value is None else type(value).__name__


class _ShapeRecorder(Interpreter):
    """Runs a GraphModule node by node and keeps a description of each node's output."""

    def __init__(self, gm: GraphModule, into: dict[str, str]) -> None:
        super().__init__(gm)
        self.into = into

    def run_node(self, n: Node) -> Any:
        out = super().run_node(n)
        if n.op != "output":
            self.into[n.name] = describe_value(out)
        return out


def _run(gm: GraphModule, args: tuple, kwargs: dict, into: dict[str, str]) -> Any:
    """Call gm on the model's own arguments through the interpreter (flattened by gm's input spec)."""
    spec = getattr(gm, "_in_spec", None)
    flat = tree_flatten_spec((args, kwargs), spec) if spec is not None else list(args)
    out = _ShapeRecorder(gm, into).run(*flat)
    out_spec = getattr(gm, "_out_spec", None)
    if out_spec is not None:  # give the output back in the model's own structure
        from torch.utils._pytree import tree_unflatten
        out = tree_unflatten(list(out) if isinstance(out, (tuple, list)) else [out], out_spec)
    return out


def trace(sharded: Any, args: tuple, kwargs: dict) -> Trace:
    """Run the captured graph and all ranks once on (args, kwargs), under no_grad."""
    captured: dict[str, str] = {}
    ranks = [sharded.rank(r) for r in range(sharded.world_size)]  # built here, not on the rank threads
    per_rank: list[dict[str, str]] = [{} for _ in ranks]
    with torch.no_grad():
        _run(sharded.captured, args, kwargs, captured)
        with record() as events:
            outputs = simulate_ranks(len(ranks), lambda r: _run(ranks[r], args, kwargs, per_rank[r]))
    mine = [e for e in events if e.rank == 0 and e.phase == "forward"]
    return Trace(captured, per_rank, mine, outputs)
