"""What a sharding rule can ask about the graph, and what it answers."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

import sympy
import torch
from torch.fx import Node

from tpcompile.placement import REPLICATE, ParamSlice, Placement, Replicate, Shard
from tpcompile.sharding_rules.table import op_name

Size = Any  # an int or a sympy expression (a dynamic dimension)


@dataclass
class Want:
    """What a rule needs one tensor input to be before the op runs."""

    node: Node
    placement: Placement
    grad_sync: bool = False  # replicated input used by a sharded op: its gradient is partial


class Choice(str):
    """A conflict that is a planned choice, not a failure: its seeds are replicated without a warning and the
    reason is shown in the plan (kv heads that do not line up with the query heads over the ranks)."""


@dataclass
class Result:
    """A rule's answer for one node: output placement and what it needs of its inputs."""

    out: Any  # a Placement, or a tuple of them for multi-output ops
    wants: list[Want] = field(default_factory=list)
    role: str = "generic"  # column | row | vocab | replicated | generic
    params: dict[Node, Optional[ParamSlice]] = field(default_factory=dict)
    localize: Optional[list[tuple]] = None  # (kind, arg index, position, divisor) of size literals
    conflict: Optional[str] = None  # why the op cannot run on its sharded inputs
    demote_self: Optional[str] = None  # a seed that cannot be split, and why
    blame: Optional[list[Node]] = None  # the inputs at fault in a conflict (default: all sharded)
    regroup: Optional[int] = None  # the conflict goes away if the origins split into this many pieces
    unpiece: Optional[list[Node]] = None  # inputs in pieces shared by ranks: the conflict goes away if their
    # origins' pieces go one to a rank, zero-padded
    note: Optional[str] = None  # why a weight op is deliberately left whole (shown in the plan)


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


def _no_pieces(node: Node) -> Optional[int]:
    return None


def _no_bodies(body: Any, inputs: list, grads: list, ctx: "RuleContext") -> tuple:
    return None, "region bodies are placed only during propagation", None


@dataclass(frozen=True)
class RuleContext:
    """Read-only view of the graph and the placements decided so far (built by propagate's sweep)."""

    world_size: int
    placement: Callable[[Any], Placement]  # a node's placement so far (Replicate for non-nodes)
    requires_grad: Callable[[Node], bool]  # the node's value carries a gradient
    param: Callable[[Any], Optional[torch.Tensor]]  # the parameter a get_attr node reads, else None
    is_user_input: Callable[[Node], bool]  # a model input, possibly reshaped (token ids)
    demoted: Callable[[Node], bool]  # a seed that this round replicates
    segment_hint: Callable[[Node], Optional[tuple[int, ...]]]  # a fused projection's segments (annotate)
    sequence_parallel: bool = False
    pieces_of: Callable[[Node], Optional[int]] = _no_pieces  # a seed split into fewer pieces than ranks
    unpieced: Callable[[Node], bool] = lambda n: False  # a seed whose heads, fewer than ranks, go one to a rank
    buffer: Callable[[Any], Optional[torch.Tensor]] = lambda n: None  # the buffer a get_attr node reads, else None
    split_bytes: Callable[[Node], int] = lambda n: 0  # bytes of the weights whose splits a value carries (origins)
    place_body: Callable[..., tuple] = _no_bodies  # a region's body placed node by node (passes/region_bodies.py)

    def seeing(self, placement: Callable[[Any], Placement]) -> "RuleContext":
        """The same context with placements read through `placement`."""
        return replace(self, placement=placement)

    def reduced(self, node: Node) -> Placement:
        """Where a row split's sum lands: split by tokens under sequence parallelism, else whole."""
        shape = self.shape(node)
        if not self.sequence_parallel or shape is None:
            return REPLICATE
        if not_token_split(shape, self.world_size) is None:
            return Shard(1, seq=True)
        batch = flat_tokens(node, shape)  # (B*T, C): B repetitions of T tokens, each split
        if batch is not None:
            return Shard(0, seq=True, outer=None if batch == 1 else batch)
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


_TRANSPOSES = ("aten.t.default", "aten.numpy_T.default", "aten.transpose.int", "aten.permute.default")


def weight_view(arg: Any) -> tuple[Optional[Node], bool]:
    """(the get_attr node, transposed?) for a weight argument that is a 2-D parameter read or its
    transpose (`h @ W.t()`, `W.T`), detached or not (a linear in a grad-off region reads its weight detached,
    capture/regions.py); (None, False) for anything else."""
    arg = undetached(arg)
    if not isinstance(arg, Node):
        return None, False
    if arg.op == "get_attr":
        return arg, False
    src = undetached(arg.args[0]) if arg.op == "call_function" and arg.args else None
    if not (isinstance(src, Node) and src.op == "get_attr"):
        return None, False
    op = op_name(arg.target)
    if op not in _TRANSPOSES:
        return None, False
    val = src.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 2:
        return None, False
    if op == "aten.permute.default" and [d % 2 for d in arg.args[1]] != [1, 0]:
        return None, False
    return src, True


def undetached(arg: Any) -> Any:
    """The parameter read (get_attr) behind `detach` (and `alias`) of it, else arg (a detached activation too)."""
    base = arg
    while isinstance(base, Node) and base.op == "call_function" and op_name(base.target) in _DETACH and base.args \
            and isinstance(base.args[0], Node):
        base = base.args[0]
    return base if isinstance(base, Node) and base.op == "get_attr" else arg


_DETACH = ("aten.detach.default", "aten.alias.default")


# Ops whose output entry k is input entry k, moved at most (casts, unary elementwise ops, unsqueeze, squeeze,
# transpose): a slice of the output is the op on a slice of the input.
_ENTRYWISE = {"aten.to.dtype", "aten._to_copy.default", "aten.clone.default", "aten.detach.default",
              "aten.alias.default", "aten.exp.default", "aten.neg.default", "aten.sigmoid.default",
              "aten.tanh.default", "aten.abs.default"}


def readers(node: Node) -> list[Node]:
    """The users of node that read its values (metadata assertions and size reads aside)."""
    skip = (torch.ops.aten._assert_tensor_metadata.default, torch.ops.aten.sym_size.int)
    return [u for u in node.users if u.target not in skip]


def _input_dim(node: Node, d: int) -> Optional[int]:
    """The dim of node's first input that dim d of its output holds (None where no input dim does)."""
    name, args = op_name(node.target), node.args
    if name in _ENTRYWISE:
        return d
    ndim = node.meta["val"].dim()
    if name == "aten.unsqueeze.default":
        k = args[1] % ndim
        return None if k == d else d - (k < d)
    if name == "aten.squeeze.dim":
        return d + (args[1] % args[0].meta["val"].dim() <= d)
    if name == "aten.transpose.int":
        a, b = args[1] % ndim, args[2] % ndim
        return b if d == a else a if d == b else d
    return None


def keeps_entries(node: Node) -> bool:
    """An op of one tensor that keeps its entries in place (a cast, an entry-wise unary op, unsqueeze, squeeze,
    transpose): the steps param_behind looks through."""
    return node.op == "call_function" and bool(node.args) and isinstance(node.args[0], Node) \
        and not any(isinstance(a, Node) for a in node.args[1:]) \
        and (op_name(node.target) in _ENTRYWISE or op_name(node.target) in _MOVES)


_MOVES = ("aten.unsqueeze.default", "aten.squeeze.dim", "aten.transpose.int")


def param_behind(node: Any, d: int, sole: bool = False, depth: int = 8) -> Optional[tuple[Node, int]]:
    """(the get_attr node `node` reads through fewer than `depth` entry-wise ops, the dim of it that dim d of
    `node` holds), else None; with `sole`, each value on the way (the get_attr included) has no other reader."""
    for _ in range(depth):
        if not isinstance(node, Node):
            return None
        if node.op == "get_attr":
            return (node, d) if not sole or len(readers(node)) == 1 else None
        if node.op != "call_function" or not node.args or not isinstance(node.args[0], Node) \
                or any(isinstance(a, Node) for a in node.args[1:]):
            return None
        if sole and len(readers(node.args[0])) != 1:
            return None
        d = _input_dim(node, d)
        if d is None:
            return None
        node = node.args[0]
    return None


def param_view_chain(node: Any) -> list:
    """The nodes from `node` back to the parameter it views (param_behind), the parameter included, else none."""
    found, chain = param_behind(node, 0, depth=5), [node]
    while found is not None and chain[-1] is not found[0]:
        chain.append(chain[-1].args[0])
    return chain if found is not None else []


def flat_tokens(node: Node, shape: Sequence[Size]) -> Optional[Size]:
    """The batch size B when a 2-D value's first dim is a model input's batch x tokens, (B*T, C) (GPT-2's Conv1D
    and OPT flatten the tokens before a projection), else None."""
    if len(shape) != 2 or isinstance(shape[0], int):
        return None
    for ph in node.graph.nodes:
        if ph.op == "call_function":
            break  # the inputs (and attribute reads) come first
        if ph.op != "placeholder":
            continue
        s = RuleContext.shape(ph)
        if s is not None and len(s) >= 2 and not isinstance(s[1], int) and sizes_equal(s[0] * s[1], shape[0]):
            return s[0]
    return None


def not_token_split(shape: Sequence[Size], world_size: int) -> Optional[str]:
    """Why a row split's sum of this shape cannot land split by tokens on dim 1, or None when it can.

    Any count of tokens splits, fixed by the model (a vision transformer's patches) or not: the first
    T % world_size ranks hold one token more (layouts/token_shares.py). One token is not split.
    """
    if len(shape) < 3:
        return f"its sum {tuple(shape)} has no dim of tokens (nor a model input's batch x tokens flattened)"
    if isinstance(shape[1], int) and shape[1] < 2:
        return f"its {shape[1]} token (fixed by the model) is not split: all-reduced"
    return None


def norm_dim(dim: int, ndim: int) -> int:
    """A dimension index made non-negative."""
    return dim + ndim if dim < 0 else dim


def period(xs: list) -> list:
    """The shortest prefix that repeats to make xs."""
    for n in range(1, len(xs) + 1):
        if len(xs) % n == 0 and xs[:n] * (len(xs) // n) == xs:
            return xs[:n]
    return xs


def exact_size(x: Size) -> Optional[Size]:
    """x as an int or a whole sympy expression, or None when it is a fraction."""
    x = sympy.simplify(sympy.sympify(x))
    if x.is_Integer:
        return int(x)
    return x if sympy.fraction(x)[1] == 1 and x.is_positive is not False else None
