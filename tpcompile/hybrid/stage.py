"""A pipeline stage as one GraphModule: root pieces inlined, each block a called submodule.

The stage's graph takes what the previous stage sends (the model inputs, for stage 0), runs its
pieces in order and returns what later stages need (the model outputs, for the last stage).
Code outside the blocks (embeddings, the final norm, the head) is copied into the stage graph
and reads its parameters at their original names on the stage itself; each block is a
`call_module` of a Block (blocks.py) at the block's own path.
"""
from __future__ import annotations

import operator

import torch
from torch import fx, nn
from torch.fx import GraphModule, Node

from tpcompile.hybrid.blocks import block_module, checkpointed, fetch, put
from tpcompile.hybrid.pieces import Piece


def _inline(graph: fx.Graph, root: nn.Module, gm: GraphModule, args: list[Node]) -> tuple:
    """Copy a root piece's rank graph into `graph`; its tensors move to `root` (a name already there stays)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out = graph.graph_copy(gm.graph, dict(zip(placeholders, args)))
    for node in gm.graph.nodes:
        if node.op == "get_attr" and fetch(root, node.target) is None:
            value = fetch(gm, node.target)
            owner = fetch(gm, node.target.rpartition(".")[0]) if "." in node.target else gm
            persistent = node.target.rpartition(".")[2] not in getattr(owner, "_non_persistent_buffers_set", ())
            put(root, node.target, value, persistent=persistent)
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def build_stage(index: int, pieces: list[Piece], ranked: list[GraphModule], inputs: list[Node],
                outputs: list[Node], *, activation_checkpointing: bool = False) -> GraphModule:
    """Stage `index` from its pieces' rank graphs: `inputs` in, `outputs` out (captured-graph values)."""
    root = nn.Module()
    graph = fx.Graph()
    env: dict[Node, Node] = {n: graph.placeholder(n.name) for n in inputs}
    for piece, gm in zip(pieces, ranked):
        args = [env[i] for i in piece.inputs]
        if piece.block:
            block = block_module(gm, piece.name)
            put(root, piece.name, checkpointed(block) if activation_checkpointing else block)
            call = graph.call_module(piece.name, tuple(args))
            results: tuple = tuple(graph.call_function(operator.getitem, (call, i)) for i in range(len(piece.outputs)))
        else:
            results = _inline(graph, root, gm, args)
        env.update(zip(piece.outputs, results))
    sent = [_contiguous(graph, env[o], o) for o in outputs]
    graph.output(tuple(sent) if len(sent) != 1 else sent[0])
    stage = GraphModule(root, graph, class_name=f"Stage{index}")
    stage.graph.eliminate_dead_code()  # (block outputs only later stages use, unused getitems)
    stage.recompile()
    for gm in [stage, *blocks_of(stage)]:
        _prune_meta(gm)
    stage.meta["stage"] = index
    stage.meta["names"] = _model_names(stage)
    return stage


def _contiguous(graph: fx.Graph, value: Node, captured: Node) -> Node:
    """`value` in one dense block when it is a tensor: send/recv move a tensor's storage as it lies."""
    val = captured.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return value
    # a view (permute, expand, a chunk) cannot be sent; contiguous() copies only those
    node = graph.call_function(torch.ops.aten.contiguous.default, (value,))
    node.meta["val"] = val
    return node


KEEP_META = ("val", "tensor_meta", "nn_module_stack", "stack_trace")


def _prune_meta(gm: GraphModule) -> None:
    """Keep shapes and module paths on each node; the compiler's own keys point back at the full-size capture."""
    for node in gm.graph.nodes:
        node.meta = {k: v for k, v in node.meta.items() if k in KEEP_META}


def _model_names(stage: GraphModule) -> dict[str, str]:
    """Each tensor's name in the stage -> its name in the model (they differ only for a block's outer buffers)."""
    names = {n: n for n, _ in list(stage.named_parameters()) + list(stage.named_buffers())}
    for path in block_paths(stage):
        for rel, target in stage.get_submodule(path).meta["outer"].items():
            names[f"{path}.{rel}"] = target
    return names


def blocks_of(stage: nn.Module) -> list[nn.Module]:
    """The stage's Block submodules, in call order."""
    return [m for m in stage.modules() if isinstance(m, GraphModule) and "block" in m.meta]


def block_paths(stage: GraphModule) -> list[str]:
    """The module paths of the stage's blocks."""
    return [n.target for n in stage.graph.nodes if n.op == "call_module"]


def root_parameters(stage: nn.Module) -> dict[str, nn.Parameter]:
    """Parameters the stage owns outside its blocks (embeddings, final norm, head), by name."""
    inside = {id(p) for b in blocks_of(stage) for p in b.parameters()}
    return {n: p for n, p in stage.named_parameters() if id(p) not in inside}

