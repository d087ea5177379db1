"""PyTorch DTensor's op strategies as the fallback for ops the op table does not place.

For an op with no row in ops.yaml (or whose rule gives up), DTensor's sharding propagation
(`torch.distributed.tensor._ops`, the strategies registered for every aten op) is asked what
output placement follows from the inputs' plain Shard/Replicate placements, on a fake 1-D
DeviceMesh of the world size (no process group). Its answer is used only when it needs no
communication: every input stays as it is or is a local slice of a replicated value, the
outputs are Shard or Replicate (no pending sum), and no size argument has to change. Anything
DTensor cannot say about our own layouts of a split dim (segments, pieces shared by ranks,
folded batch x heads) is asked as a plain split of that dim and carried over when the op keeps
that dim's size; a zero-padded split (heads, or heads folded with the batch) is asked as a plain
split of the padded size, with any whole operand as large on that dim (what the ranks hold, the
padding then not zero: a rule that needs zeros there reads `zero_padded`); zero-padded segments
stay with tpcompile's own rules. An op DTensor cannot place is replicated as before.

Shapes are the capture's (each symbolic size at its example value); an output split on a dim
the world size does not divide is refused, since our shards are even; and every answer is run
once on example inputs before it is used (fallback_check.py).
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Iterator, Optional

import sympy
import torch
from torch.fx import Node

from tpcompile.placement import REPLICATE, Placement, Replicate, Shard
from tpcompile.sharding_rules.fallback_check import agrees
from tpcompile.sharding_rules.rule_context import Result, RuleContext, Want

_MESHES: dict[int, Any] = {}
_CACHE: dict[tuple, Optional[tuple]] = {}
_NO_DTENSOR = ("aten.as_strided", "aten.argmax", "aten.argmin")  # answered by DTensor's own handlers at run time


class _Unsupported(Exception):
    """An argument DTensor's schema cannot carry (or a placement it cannot express)."""


def _mesh(world_size: int) -> Any:
    """A 1-D DeviceMesh of `world_size` CPU ranks that creates no process group."""
    if world_size not in _MESHES:
        from torch.distributed.device_mesh import DeviceMesh
        _MESHES[world_size] = DeviceMesh("cpu", list(range(world_size)), _init_backend=False, _rank=0)
    return _MESHES[world_size]


def _hint(s: Any) -> int:
    """A size as an int: its value in the capture's example when symbolic."""
    if isinstance(s, int):
        return s
    from torch.fx.experimental.symbolic_shapes import optimization_hint
    return int(optimization_hint(s, fallback=8))


def example_size(node: Node, dim: int) -> int:
    """The size of one dim of a tensor node at the capture's example sizes."""
    return _hint(node.meta["val"].shape[dim])


def example_numel(node: Node) -> int:
    """The number of elements of a tensor node at the capture's example sizes."""
    n = 1
    for s in node.meta["val"].shape:
        n *= _hint(s)
    return n


@contextmanager
def _quiet() -> Iterator[None]:
    """Fake-tensor propagation logs every op it cannot run; a refused op is an answer here, not an error."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def _ours(dp: Any, layout: Optional[Shard]) -> Optional[Placement]:
    """Our placement for a DTensor one, laid out like the inputs' splits; None for a pending sum or a strided shard."""
    from torch.distributed.tensor import Replicate as DReplicate, Shard as DShard
    if type(dp) is DReplicate:
        return REPLICATE
    if type(dp) is DShard:
        return Shard(dp.dim) if layout is None else replace(layout, dim=dp.dim)
    return None


class _Schema:
    """Builds DTensor's OpSchema arguments for one node and remembers which leaf is which input."""

    def __init__(self, node: Node, ctx: RuleContext) -> None:
        self.ctx, self.mesh = ctx, _mesh(_mesh_size(node, ctx))
        self.inputs: list[Node] = []  # tensor inputs, in DTensor's leaf order
        self.shapes: list[torch.Size] = []  # their example shapes
        self.sizes: dict[Node, int] = {}  # size arguments (sym_size nodes) at their example values
        self.layouts: set[Shard] = set()  # how the split inputs are laid out along their split dim (dim 0 here)
        self.split_sizes: set[int] = set()  # the sizes of their split dims
        self.key: list[Any] = []
        self.grown = _grown(node, ctx)  # inputs asked at a zero-padded size

    def arg(self, a: Any) -> Any:
        if isinstance(a, Node):
            if self.ctx.is_tensor(a):
                return self.tensor(a)
            v = a.meta.get("val")
            if isinstance(v, (torch.SymInt, int)):
                self.sizes[a] = _hint(v)
                self.key.append(("sym", self.sizes[a]))
                return self.sizes[a]
            raise _Unsupported(f"argument {a.name} is not a tensor or a size")
        if isinstance(a, (list, tuple)):
            return type(a)(self.arg(x) for x in a)
        if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise _Unsupported("symbolic literal")
        self.key.append(repr(a))
        return a

    def tensor(self, n: Node) -> Any:
        from torch.distributed.tensor import Replicate as DReplicate, Shard as DShard
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
        val = n.meta["val"]
        shape = torch.Size([_hint(s) for s in val.shape])
        p = self.ctx.placement(n)
        self.key.append((tuple(shape), val.dtype, p))
        if isinstance(p, Shard):
            if (p.padding is not None and not _padded(p, self.ctx.world_size)) or p.split_next is not None:
                raise _Unsupported(f"{p}: segments zero-padded or a split of the next dim")
            self.layouts.add(replace(p, dim=0))
            self.split_sizes.add(shape[p.dim])
        if n in self.grown:  # asked, and checked, at the padded size that the ranks split evenly
            dim, size = self.grown[n]
            shape = torch.Size([*shape[:dim], size, *shape[dim + 1:]])
        stride, acc = [], 1
        for s in reversed(shape):  # contiguous strides of the example shape
            stride.insert(0, acc)
            acc *= max(s, 1)
        self.inputs.append(n)
        self.shapes.append(shape)
        placed = DShard(p.dim) if isinstance(p, Shard) else DReplicate()
        return DTensorSpec(self.mesh, (placed,), TensorMeta(shape, tuple(stride), val.dtype))


def _mesh_size(node: Node, ctx: RuleContext) -> int:
    """The ranks DTensor is asked about: the pieces of an input in fewer equal pieces than ranks (4 heads at 8 ranks,
    each piece held by 2: what a piece's ranks hold is a plain split over as many ranks as pieces, which DTensor's
    view ops accept where they refuse 4 entries over 8), else the world size."""
    pieces = {p.pieces for n in node.all_input_nodes
              if ctx.is_tensor(n) and isinstance(p := ctx.placement(n), Shard) and p.in_pieces and p.pieces > 1}
    return pieces.pop() if len(pieces) == 1 else ctx.world_size


def _padded(p: Shard, ws: int) -> bool:
    """One segment zero-padded (heads, or `outer` repetitions of padded heads: batch x heads folded), or segments
    each zero-padded and cut into a piece a rank (q|k|v padded by whole heads)."""
    if p.seg_padded:
        return p.outer is None and not p.seq and set(p.counts(ws)) == {ws}
    return p.padded is not None and p.pieces is None and not p.seq


def _padded_size(p: Shard) -> int:
    """The size a zero-padded split's dim is asked at: its padding, every segment's together."""
    return sum(p.pads()) if p.seg_padded else p.padded


def _grown(node: Node, ctx: RuleContext) -> dict[Node, tuple[int, int]]:
    """(dim, padded size) of the inputs split zero-padded, and of the whole ones as large as they are on that dim
    (an ALiBi bias of batch x heads beside queries split by padded heads), which DTensor then sees alike."""
    tensors = [n for n in node.all_input_nodes if ctx.is_tensor(n)]
    split = [(n, p) for n in tensors if isinstance(p := ctx.placement(n), Shard) and _padded(p, ctx.world_size)]
    if not split:
        return {}
    n0, p0 = split[0]
    real = _hint(n0.meta["val"].shape[p0.dim])
    size = _padded_size(p0) * (1 if p0.outer is None else _outer_value(node)(p0.outer))
    whole = [n for n in tensors if isinstance(ctx.placement(n), Replicate)
             and n.meta["val"].dim() == n0.meta["val"].dim() and _hint(n.meta["val"].shape[p0.dim]) == real]
    return {n: (p.dim, size) for n, p in split} | {n: (p0.dim, size) for n in whole}


def _leaves(schema: Any) -> list[Any]:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.utils._pytree import tree_leaves
    return [x for x in tree_leaves((schema.args_schema, schema.kwargs_schema)) if isinstance(x, DTensorSpec)]


def _propagate(node: Node, ctx: RuleContext) -> tuple[list[Node], Optional[tuple]]:
    """The tensor inputs, and (their placements wanted, output placements) DTensor gives with no
    communication, else None."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._op_schema import OpSchema
    op = node.target
    b = _Schema(node, ctx)
    args = tuple(b.arg(a) for a in node.args)
    kwargs = {k: b.arg(v) for k, v in node.kwargs.items()}
    key = (op, ctx.world_size, b.mesh.size(), tuple(b.key), tuple(node.kwargs))
    if key in _CACHE:
        return b.inputs, _CACHE[key]
    if len(b.layouts) > 1:
        return b.inputs, None  # splits laid out differently (a token split and a feature split, say)
    prop = DTensor._op_dispatcher.sharding_propagator
    info = prop.op_to_schema_info.get(op) or prop.op_to_schema_info_for_single_dim_strategy.get(op)
    schema = OpSchema(op, args, kwargs, schema_info=info)
    try:
        with _quiet():
            out = prop.propagate_op_sharding_non_cached(schema)
        answer = _answer(out, schema, b, node, ctx)
    except Exception:  # noqa: BLE001  no strategy, or the op cannot run on these shapes: no answer
        answer = None
    if answer is not None and not agrees(node, b.inputs, b.shapes, answer[0], answer[1], b.sizes, ctx.world_size,
                                         _outer_value(node)):
        answer = None
    if len(_CACHE) > 4096:
        _CACHE.clear()
    _CACHE[key] = answer
    return b.inputs, answer


def _answer(out: Any, schema: Any, b: _Schema, node: Node, ctx: RuleContext) -> Optional[tuple]:
    """DTensor's answer in our placements, or None when it needs communication or changed arguments."""
    layout = next(iter(b.layouts)) if b.layouts else None
    wanted = _leaves(out.redistribute_schema) if out.redistribute_schema is not None else _leaves(schema)
    if len(wanted) != len(b.inputs):
        return None
    wants = []
    for n, spec in zip(b.inputs, wanted):
        have, want = ctx.placement(n), _ours(spec.placements[0], layout)
        if want is None or (have != want and not isinstance(have, Replicate)):
            return None  # a partial input, or a split input moved: communication
        if isinstance(want, Shard) and not isinstance(have, Shard) and want.seq:
            return None  # a local slice of tokens would be a new token split
        wants.append(want)
    specs = out.output_spec
    many = isinstance(specs, (tuple, list))
    vals = node.meta["val"] if many else [node.meta["val"]]
    outs = []
    for spec, val in zip(specs if many else [specs], vals):
        p = REPLICATE if spec is None else _ours(spec.placements[0], layout)
        if p is None:
            return None
        if isinstance(p, Shard) and (not layout.plain or layout.seq) and {_hint(val.shape[p.dim])} != b.split_sizes:
            # the op changes the size of a dim laid out in segments or pieces, or of the token dim, whose
            # per-rank share is known only at run time (a reshape of tokens is shape.py's to decide)
            return None
        outs.append(p)
    if out.use_val_from_redistribute_schema and any(isinstance(p, Shard) for p in outs):
        return None  # DTensor would change a size argument for the local op
    return tuple(wants), (tuple(outs) if many else outs[0])


def _outer_value(node: Node) -> Any:
    """A function giving a size expression's value at the capture's example sizes (a split's `outer`)."""
    env: dict = {}
    for n in node.all_input_nodes:
        val = n.meta.get("val")
        for s in getattr(val, "shape", ()):
            if isinstance(s, torch.SymInt):
                shape_env = s.node.shape_env  # torch >= 2.10 names the example values backed_var_to_val
                env = getattr(shape_env, "backed_var_to_val", None) or shape_env.var_to_val
                break
    return lambda expr: int(expr) if isinstance(expr, int) else int(sympy.sympify(expr).subs(env))


def _splits_evenly(node: Node, out: Any, ws: int) -> bool:
    """Every split output dim is a multiple of the world size (a run-time count of tokens splits in shares)."""
    vals = node.meta.get("val")
    vals = vals if isinstance(vals, (tuple, list)) else [vals]
    for p, v in zip(out if isinstance(out, tuple) else [out], vals):
        if isinstance(p, Shard):
            if not isinstance(v, torch.Tensor) or p.dim >= v.dim():
                return False
            if not p.plain:
                continue  # its size is the input's (checked in _answer), which the world size divides
            size = v.shape[p.dim]
            if isinstance(size, int) and size % ws or not isinstance(size, int) and not p.seq:
                return False
    return True


def dtensor_result(node: Node, ctx: RuleContext) -> Optional[Result]:
    """What DTensor's strategy for this op says, as a rule's Result, when it needs no communication; else None."""
    op = node.target
    if not isinstance(op, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded in op.tags:
        return None  # a random op's values would differ from the original's anyway
    if any(str(op).startswith(name) for name in _NO_DTENSOR):
        return None
    try:
        inputs, answer = _propagate(node, ctx)
    except _Unsupported:
        return None
    if answer is None:
        return None
    wants_p, out = answer
    if not _splits_evenly(node, out, ctx.world_size):
        return None
    split_out = any(isinstance(p, Shard) for p in (out if isinstance(out, tuple) else [out]))
    wants = []
    for n, p in zip(inputs, wants_p):
        if isinstance(p, Replicate) and split_out:
            wants.append(ctx.replicated_want(n, Shard(0)))  # a whole input to a split op: its gradient is partial
        else:
            wants.append(Want(n, p))
    return Result(out, wants)
