"""The rank module: the rank graph with this rank's slices of the parameters and buffers, and the constants."""
from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn
from torch.fx import GraphModule

from tpcompile.passes.decisions import Decisions
from tpcompile.placement import rank_pieces, slice_shape


def local_tensor(t: torch.Tensor, sl: Any, rank: int, ws: int) -> torch.Tensor:
    """This rank's piece of a parameter (a copy, so ranks never share storage)."""
    if sl is None:
        return t.detach().clone()
    out = t.new_zeros(slice_shape(t.shape, sl, ws))  # what no run covers is vocabulary padding
    for start, local, n in rank_pieces(sl, t.shape[sl.dim], rank, ws):
        out.narrow(sl.dim, local, n).copy_(t.detach().narrow(sl.dim, start, n))
    return out


def build_rank_module(gm: GraphModule, plan: Decisions, rank: int, graph: fx.Graph) -> GraphModule:
    """Wrap the rank graph with this rank's parameters (tied ones kept as one object), buffers and constants."""
    root = nn.Module()
    made: dict[int, torch.Tensor] = {}
    params = dict(gm.named_parameters(remove_duplicate=False))
    for name, t in plan.tensors.items():
        if id(t) not in made:
            local = local_tensor(t, plan.slice_for(name), rank, plan.world_size)
            made[id(t)] = nn.Parameter(local, requires_grad=t.requires_grad) if name in params else local
        _set(root, name, made[id(t)], is_param=name in params)
    for name, mod in gm.named_children():
        if not any(k.startswith(name + ".") for k in plan.tensors):
            setattr(root, name, mod)
    for node in graph.nodes:  # a region's body as this rank runs it (passes/rewrite_regions.py)
        if node.op == "get_attr" and "tp_body" in node.meta:
            _set(root, node.target, node.meta["tp_body"], is_param=False, constant=True)
    for node in graph.nodes:  # tensor literals of forward (torch.export lifts them to attributes): replicated
        if node.op == "get_attr" and node.target not in plan.tensors and not _has(root, node.target):
            _set(root, node.target, _get(gm, node.target), is_param=False, constant=True)
    out = GraphModule(root, graph, class_name=f"ShardedRank{rank}")
    for attr in ("_in_spec", "_out_spec"):
        if hasattr(gm, attr):
            setattr(out, attr, getattr(gm, attr))
    return out


def _get(root: nn.Module, name: str) -> object:
    for part in name.split("."):
        root = getattr(root, part)
    return root


def _has(root: nn.Module, name: str) -> bool:
    try:
        _get(root, name)
    except AttributeError:
        return False
    return True


def _set(root: nn.Module, name: str, value: object, *, is_param: bool, constant: bool = False) -> None:
    *path, leaf = name.split(".")
    mod = root
    for p in path:
        if not hasattr(mod, p):
            mod.add_module(p, nn.Module())
        mod = getattr(mod, p)
    if is_param or constant:  # a constant is a plain attribute, not part of the state dict
        setattr(mod, leaf, value)
    else:
        mod.register_buffer(leaf, value)
