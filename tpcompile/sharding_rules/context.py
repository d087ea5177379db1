"""What a sharding rule can ask about the graph, and what it answers."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import sympy
import torch
from torch.fx import Node

from tpcompile.placement import REPLICATE, Placement, Replicate, Shard

Size = Any  # an int or a sympy expression (a dynamic dimension)


@dataclass(frozen=True)
class ParamSlice:
    """How a parameter is cut: along `dim`, per segment when segmented."""

    dim: int
    segments: Optional[tuple[int, ...]] = None
    padded: Optional[int] = None  # cut as if zero-padded to this size
    groups: Optional[int] = None  # cut into this many pieces, each held by world_size/groups ranks


@dataclass
class Want:
    """What a rule needs one tensor input to be before the op runs."""

    node: Node
    placement: Placement
    grad_sync: bool = False  # replicated input used by a sharded op: its gradient is partial


@dataclass
class Result:
    """A rule's answer for one node: output placement and what it needs of its inputs."""

    out: Any  # a Placement, or a tuple of them for multi-output ops
    wants: list[Want] = field(default_factory=list)
    role: str = "generic"  # column | row | vocab | replicate | generic
    params: dict[Node, Optional[ParamSlice]] = field(default_factory=dict)
    localize: Optional[list[tuple]] = None  # (kind, arg index, position, divisor) of size literals
    conflict: Optional[str] = None  # why the op cannot run on its sharded inputs
    demote_self: Optional[str] = None  # a seed that cannot be split, and why
    blame: Optional[list[Node]] = None  # the inputs at fault in a conflict (default: all sharded)
    regroup: Optional[int] = None  # the conflict goes away if the origins split into this many pieces


def to_size(s: Any) -> Size:
    """A concrete int, or the sympy expression of a symbolic size."""
    if isinstance(s, int):
        return s
    if isinstance(s, torch.SymInt):
        expr = s.node.expr
        return int(expr) if expr.is_number else expr
    return s


def sizes_equal(a: Size, b: Size) -> bool:
    """True when two sizes (ints or sympy expressions) are provably equal."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return sympy.simplify(sympy.sympify(a) - sympy.sympify(b)) == 0


def prod(sizes: Sequence[Size]) -> Size:
    """Product of sizes, int when every factor is an int."""
    out: Size = 1
    for s in sizes:
        out = out * s
    return int(out) if isinstance(out, int) or getattr(out, "is_number", False) else out


class RuleContext:
    """Read-only view of the graph and the placements decided so far."""

    def __init__(self, world_size: int, placement_of: Callable[[Node], Placement],
                 requires_grad: Callable[[Node], bool], param_of: Callable[[Node], Optional[torch.Tensor]],
                 is_user_input: Callable[[Node], bool], demoted: Callable[[Node], bool],
                 segment_hint: Callable[[Node], Optional[tuple[int, ...]]]) -> None:
        self.world_size = world_size
        self.placement = placement_of
        self.requires_grad = requires_grad
        self.param = param_of
        self.is_user_input = is_user_input
        self.demoted = demoted
        self.segment_hint = segment_hint
        self.sequence_parallel = False
        self.groups_of: Callable[[Node], Optional[int]] = lambda n: None

    def seeing(self, placement_of: Callable[[Node], Placement]) -> "RuleContext":
        """The same context with placements read through `placement_of`."""
        other = copy.copy(self)
        other.placement = placement_of
        return other

    def reduced(self, node: Node) -> Placement:
        """Where a row split's sum lands: split by tokens under sequence parallelism, else whole."""
        shape = self.shape(node)
        if self.sequence_parallel and shape is not None and len(shape) >= 3 and not isinstance(shape[1], int):
            return Shard(1, seq=True)
        return REPLICATE

    @staticmethod
    def shape(node: Any) -> Optional[tuple[Size, ...]]:
        """The (global) shape of a tensor-valued node, or None."""
        val = node.meta.get("val") if isinstance(node, Node) else None
        if isinstance(val, torch.Tensor):
            return tuple(to_size(s) for s in val.shape)
        return None

    @staticmethod
    def is_tensor(node: Any) -> bool:
        """True for a node whose value is a tensor."""
        return isinstance(node, Node) and isinstance(node.meta.get("val"), torch.Tensor)

    def replicated_want(self, node: Node, out: Placement) -> Want:
        """Want a replicated input as is; sync its gradient when the op's output is sharded."""
        sync = isinstance(out, Shard) and self.requires_grad(node)
        return Want(node, REPLICATE, grad_sync=sync)

    def all_replicated(self, nodes: Sequence[Any]) -> bool:
        """True when every tensor among `nodes` is replicated."""
        return all(isinstance(self.placement(n), Replicate) for n in nodes if self.is_tensor(n))


def norm_dim(dim: int, ndim: int) -> int:
    """A dimension index made non-negative."""
    return dim + ndim if dim < 0 else dim
