"""Lowering pass for torch.compile: tpcompile's collectives become `torch.ops._c10d_functional` calls.

Dynamo and inductor know the functional collectives (`_c10d_functional.all_reduce`,
`all_gather_into_tensor`, `reduce_scatter_tensor`, `wait_tensor`): inductor's communication
passes reorder, bucket and overlap them. tpcompile's own ops are opaque custom ops to it. This
pass swaps every `torch.ops.tpcompile.*` node of a rank graph for the function of
`tpcompile/ops/c10d.py` with the same forward and backward, given the torch.distributed
group's name, this rank and the world size as constants. It runs after the per-rank verifier
(which reads the tpcompile ops) and needs an initialised process group; the simulator cannot
run a lowered graph. Each lowered node keeps `node.meta['tp_lowered']`: the op it replaced.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.fx import GraphModule

import tpcompile.ops.async_ops  # noqa: F401  (tpcompile_async.wait, which lowering drops)
from tpcompile.errors import TPCompileError
from tpcompile.ops.c10d import LOWERED
from tpcompile.ops.schedule import collective_op
from tpcompile.runtime.backends import DistBackend, current_backend

META_KEY = "tp_lowered"


def _group(key: str) -> tuple[str, int, int]:
    """(group name, rank, world size) of the torch.distributed group behind a collective's group key."""
    backend = current_backend(key)
    if not isinstance(backend, DistBackend):
        raise TPCompileError(f"lowering collectives of group {key!r} to torch.ops._c10d_functional needs "
                             f"torch.distributed initialised in this process (torchrun or init_process_group); "
                             f"a simulated rank runs tpcompile's own collectives, without comm lowering")
    pg = backend.pg if backend.pg is not None else dist.group.WORLD
    return pg.group_name, backend.rank, backend.world_size


def lower_pass(gm: GraphModule) -> GraphModule:
    """Replace each torch.ops.tpcompile collective of gm with its _c10d_functional spelling, in place."""
    groups: dict[str, tuple[str, int, int]] = {}
    for node in list(gm.graph.nodes):
        if node.target is torch.ops.tpcompile_async.wait.default:  # the lowered start is already the sum
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            continue
        op = collective_op(node)
        if op is None:
            continue
        if op not in LOWERED:
            raise TPCompileError(f"tpcompile.{op} ({node.name}) has no _c10d_functional lowering; "
                                 f"compile the rank graph without comm lowering")
        fn, ranked = LOWERED[op]
        key = node.args[-1]
        if key not in groups:
            groups[key] = _group(key)
        name, rank, ws = groups[key]
        node.meta[META_KEY] = f"tpcompile.{op}"
        node.args = (*node.args[:-1], rank, ws, name) if ranked else (*node.args[:-1], name)
        node.target = fn
    gm.recompile()
    return gm
