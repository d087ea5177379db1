"""Block submodules: a block's rank graph as a called GraphModule that owns its parameters.

FSDP2 gathers a unit's parameters when that unit's forward is called, so per-block
`fully_shard` needs each block to be a submodule whose forward reads its own parameters. A
block's rank graph reads them by their full dotted names ("transformer.h.3.attn.c_attn.weight");
the block module holds them relative to the block ("attn.c_attn.weight") and sits at the block's
path in the stage, so the stage's parameter names are the model's own.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import fx, nn
from torch.fx import GraphModule
from torch.utils.checkpoint import checkpoint

from tpcompile.errors import TPCompileError

OUTER_PREFIX = "_outer_"  # buffers a block reads from outside its own path (a shared rotary table)


def fetch(root: nn.Module, target: str) -> Any:
    """The attribute at dotted `target` (None when absent)."""
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def put(root: nn.Module, target: str, value: Any, *, persistent: bool = True) -> None:
    """Set a parameter, buffer or module at dotted `target`, creating empty modules on the way."""
    *path, leaf = target.split(".")
    mod = root
    for p in path:
        if not hasattr(mod, p):
            mod.add_module(p, nn.Module())
        mod = getattr(mod, p)
    if isinstance(value, nn.Parameter) or isinstance(value, nn.Module):
        setattr(mod, leaf, value)
    elif isinstance(value, torch.Tensor):
        mod.register_buffer(leaf, value, persistent=persistent)
    else:
        setattr(mod, leaf, value)


def copy_graph(gm: GraphModule) -> fx.Graph:
    """A fresh copy of gm's graph (placeholders, nodes and output)."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return graph


def block_module(gm: GraphModule, prefix: str) -> GraphModule:
    """The rank graph of the block at `prefix` as a module owning its tensors under relative names."""
    root = nn.Module()
    graph = copy_graph(gm)
    outer: dict[str, str] = {}
    for node in graph.nodes:
        if node.op != "get_attr":
            continue
        value = fetch(gm, node.target)
        if node.target.startswith(prefix + "."):
            rel = node.target[len(prefix) + 1:]
        elif isinstance(value, nn.Parameter):
            raise TPCompileError(f"block {prefix} uses the parameter {node.target} of another module; a block "
                                 f"that shares weights with the rest of the model cannot own them for FSDP or "
                                 f"pipeline stages: untie them, or use pp=1 with data_parallel='ddp'")
        else:
            rel = OUTER_PREFIX + node.target.replace(".", "_")
            outer[rel] = node.target
        if fetch(root, rel) is None:
            put(root, rel, value, persistent=False if rel.startswith(OUTER_PREFIX) else True)
        node.target = rel
    out = GraphModule(root, graph, class_name="Block")
    out.meta["block"] = prefix
    out.meta["outer"] = outer  # relative name -> the model's name, of tensors from outside the block
    return out


def checkpointed(module: nn.Module) -> nn.Module:
    """Recompute the module's forward in backward instead of keeping its activations (activation checkpointing)."""
    inner: Callable[..., Any] = module.forward

    def forward(*args: Any) -> Any:
        return checkpoint(inner, *args, use_reentrant=False)

    module.forward = forward  # an instance attribute: FSDP's hooks still run around it
    return module
