"""PyTorch DTensor's op strategies as the fallback for ops the op table does not place.

For an op with no row in ops.yaml (or whose rule gives up), DTensor's sharding propagation
(`torch.distributed.tensor._ops`, the strategies registered for every aten op) is asked what
output placement follows from the inputs' plain Shard/Replicate placements, on a fake 1-D
DeviceMesh of the world size (no process group). Its answer is used only when it needs no
communication: every input stays as it is or is a local slice of a replicated value, the
outputs are Shard or Replicate (no pending sum), and no size argument has to change. Anything
DTensor cannot say (segments, padded vocabularies, pieces shared by ranks, folded batch x
heads) stays with tpcompile's own rules; an op it cannot place is replicated as before.

Shapes are the capture's (each symbolic size at its example value); an output split on a dim
the world size does not divide is refused, since our shards are even; and every answer is run
once on example inputs before it is used (fallback_check.py).
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Iterator, Optional

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


def _dt_placement(p: Placement) -> Any:
    from torch.distributed.tensor import Replicate as DReplicate, Shard as DShard
    if isinstance(p, Replicate):
        return DReplicate()
    if isinstance(p, Shard) and (p.plain or p.seq) and p.split_next is None:
        return DShard(p.dim)
    raise _Unsupported(f"{p} has no DTensor placement")


def _ours(dp: Any, seq: bool) -> Optional[Placement]:
    """Our placement for a DTensor one; None for a pending sum or a strided shard."""
    from torch.distributed.tensor import Replicate as DReplicate, Shard as DShard
    if type(dp) is DReplicate:
        return REPLICATE
    if type(dp) is DShard:
        return Shard(dp.dim, seq=seq)
    return None


class _Schema:
    """Builds DTensor's OpSchema arguments for one node and remembers which leaf is which input."""

    def __init__(self, node: Node, ctx: RuleContext) -> None:
        self.ctx, self.mesh = ctx, _mesh(ctx.world_size)
        self.inputs: list[Node] = []  # tensor inputs, in DTensor's leaf order
        self.shapes: list[torch.Size] = []  # their example shapes
        self.sizes: dict[Node, int] = {}  # size arguments (sym_size nodes) at their example values
        self.key: list[Any] = []

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
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
        val = n.meta["val"]
        shape = torch.Size([_hint(s) for s in val.shape])
        stride, acc = [], 1
        for s in reversed(shape):  # contiguous strides of the example shape
            stride.insert(0, acc)
            acc *= max(s, 1)
        p = self.ctx.placement(n)
        self.inputs.append(n)
        self.shapes.append(shape)
        self.key.append((tuple(shape), val.dtype, p))
        return DTensorSpec(self.mesh, (_dt_placement(p),), TensorMeta(shape, tuple(stride), val.dtype))


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
    key = (op, ctx.world_size, tuple(b.key), tuple(node.kwargs))
    if key in _CACHE:
        return b.inputs, _CACHE[key]
    prop = DTensor._op_dispatcher.sharding_propagator
    info = prop.op_to_schema_info.get(op) or prop.op_to_schema_info_for_single_dim_strategy.get(op)
    schema = OpSchema(op, args, kwargs, schema_info=info)
    try:
        with _quiet():
            out = prop.propagate_op_sharding_non_cached(schema)
    except Exception:  # noqa: BLE001  no strategy, or the op cannot run on these shapes: no answer
        _CACHE[key] = None
        return b.inputs, None
    if len(_CACHE) > 4096:
        _CACHE.clear()
    answer = _answer(out, schema, b.inputs, ctx)
    if answer is not None and not agrees(node, b.inputs, b.shapes, answer[0], answer[1], b.sizes, ctx.world_size):
        answer = None
    _CACHE[key] = answer
    return b.inputs, answer


def _answer(out: Any, schema: Any, inputs: list[Node], ctx: RuleContext) -> Optional[tuple]:
    """DTensor's answer in our placements, or None when it needs communication or changed arguments."""
    seqs = {ctx.placement(n).seq for n in inputs if isinstance(ctx.placement(n), Shard)}
    if len(seqs) > 1:
        return None  # a token split meeting a feature split: not one mesh dimension
    seq = seqs.pop() if seqs else False
    wanted = _leaves(out.redistribute_schema) if out.redistribute_schema is not None else _leaves(schema)
    if len(wanted) != len(inputs):
        return None
    wants = []
    for n, spec in zip(inputs, wanted):
        have, want = ctx.placement(n), _ours(spec.placements[0], seq)
        if want is None or (have != want and not isinstance(have, Replicate)):
            return None  # a partial input, or a split input moved: communication
        if isinstance(want, Shard) and not isinstance(have, Shard) and seq:
            return None  # a local slice of tokens would be a new token split
        wants.append(want)
    specs = out.output_spec
    many = isinstance(specs, (tuple, list))
    outs = []
    for spec in (specs if many else [specs]):
        p = REPLICATE if spec is None else _ours(spec.placements[0], seq)
        if p is None:
            return None
        outs.append(p)
    if out.use_val_from_redistribute_schema and any(isinstance(p, Shard) for p in outs):
        return None  # DTensor would change a size argument for the local op
    return tuple(wants), (tuple(outs) if many else outs[0])


def _splits_evenly(node: Node, out: Any, ws: int) -> bool:
    """Every split output dim is a multiple of the world size (a token dim is checked at run time)."""
    vals = node.meta.get("val")
    vals = vals if isinstance(vals, (tuple, list)) else [vals]
    for p, v in zip(out if isinstance(out, tuple) else [out], vals):
        if isinstance(p, Shard):
            if not isinstance(v, torch.Tensor) or p.dim >= v.dim():
                return False
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
