"""The profiling pass: a copy of a rank graph whose blocks and collectives run inside record_function regions.

Each contiguous run of nodes of one block (a repeated layer of the model, or the code before the
first layer ("pre") or after the last ("post"), as the planner cuts the model: strategy/profile.py)
runs between `torch.ops.profiler._record_function_enter_new` and `_record_function_exit` nodes, and
so does each collective node, under a name that carries its op, module path, node and bytes. The
copy's code becomes the module's `forward` (an instance attribute, removed again by the function
`install` returns), reading the module's own tensors, so FSDP's and DDP's hooks and parameter
swaps still apply; the module's graph is left as it was. A rank module from `tpcompile.parallelize`
already has an instance `forward` (the dispatch of refused input shapes, runtime/shape_cache.py):
the copy's code goes into that dispatch's `graph_forward` instead, and comes out of it again.
"""
from __future__ import annotations

import copy
import re
import types
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import fx, nn
from torch.fx import GraphModule, Node
from torch.utils import _pytree as pytree

from tpcompile.passes.pass_context import module_path

__all__ = ["BLOCK", "COLLECTIVE", "PIPELINE", "REGION", "STEP", "Installed", "install", "instrumented_graph",
           "graph_slot", "node_blocks", "parse_collective", "repeated_layers"]

BLOCK = "tpcompile.block "  # + the block's name
COLLECTIVE = "tpcompile.collective "  # + 'op @ module (node) [bytes B]'
REGION = "tpcompile.region "  # + a name the user's loop gives (Profile.region)
STEP = "tpcompile.step "  # + the step's number
PIPELINE = "tpcompile.pipeline "  # + what a pipeline stage waits for (its peers' sends)
NAMESPACES = ("tpcompile", "tpcompile_async")  # the ops that communicate (and the wait of an asynchronous one)
_LABEL = re.compile(r"^(?P<op>\S+) @ (?P<module>\S*) \((?P<node>[^)]*)\) \[(?P<bytes>\d+) B\]$")

_enter = torch.ops.profiler._record_function_enter_new.default
_exit = torch.ops.profiler._record_function_exit._RecordFunction


def collective_target(node: Node) -> Optional[str]:
    """The op a collective node calls ('all_reduce', 'wait', ...), else None."""
    if node.op != "call_function" or getattr(node.target, "namespace", None) not in NAMESPACES:
        return None
    return str(getattr(node.target, "_opname", node.target))


def _nbytes(value: Any) -> int:
    """Bytes of every tensor in value (a tensor, or a list of them: a gradient bucket)."""
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor))


def enter_collective(value: Any, label: str) -> Any:
    """Open the record_function region of one collective call, its input's bytes in the name."""
    return _enter(f"{COLLECTIVE}{label} [{_nbytes(value)} B]", None)


def parse_collective(name: str) -> Optional[dict[str, Any]]:
    """{'op', 'module', 'node', 'bytes'} from a collective region's name, else None."""
    if not name.startswith(COLLECTIVE):
        return None
    m = _LABEL.match(name[len(COLLECTIVE):])
    if m is None:
        return None
    return {"op": m["op"], "module": m["module"], "node": m["node"], "bytes": int(m["bytes"])}


def repeated_layers(graphs: Iterable[fx.Graph]) -> list[str]:
    """Module paths of the model's repeated layers, read off the nodes' nn_module_stack.

    Siblings `P.0, P.1, ...` of one module type form a group, as the planner's find_layers counts
    them: a container whose numbered children are of several types (a Sequential of Linear and ReLU)
    holds none; groups inside a member of another group (a Sequential inside each layer) are left
    out, and the largest remaining group wins.
    """
    groups: dict[tuple[str, str], set[str]] = defaultdict(set)
    for graph in graphs:
        for node in graph.nodes:
            for value in (node.meta.get("nn_module_stack") or {}).values():
                if not isinstance(value, tuple) or len(value) < 2:
                    continue
                path, kind = str(value[0]), str(value[1])
                parent, _, last = path.rpartition(".")
                if last.isdigit() and parent:
                    groups[(parent, kind)].add(path)
    kinds: dict[str, set[str]] = defaultdict(set)
    for parent, kind in groups:
        kinds[parent].add(kind)
    groups = {k: v for k, v in groups.items() if len(kinds[k[0]]) == 1}
    members = {p for paths in groups.values() for p in paths}
    outer = {k: v for k, v in groups.items()
             if not any(k[0] == m or k[0].startswith(m + ".") for m in members)}
    if not outer:
        return []
    best = max(outer.values(), key=len)
    return sorted(best, key=lambda p: int(p.rpartition(".")[2]))


def _layer_of(path: str, layers: Sequence[str]) -> Optional[str]:
    """The layer whose module covers `path`, or None."""
    for layer in layers:
        if path == layer or path.startswith(layer + "."):
            return layer
    return None


def _path(node: Node) -> str:
    """The module a node runs in: a call_module's own target, else its innermost nn_module_stack entry."""
    return str(node.target) if node.op == "call_module" else module_path(node)


def node_blocks(graph: fx.Graph, layers: Sequence[str]) -> dict[Node, str]:
    """Each computing node's block: its layer, else 'pre' before the first layer's nodes, 'post' after the last,
    else the layer before it ('model' when there are no layers), as the planner assigns them."""
    nodes = [n for n in graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    owner = {n: _layer_of(_path(n), layers) for n in nodes}
    placed = [i for i, n in enumerate(nodes) if owner[n] is not None]
    if not layers:
        return {n: "model" for n in nodes}
    first, last = (placed[0], placed[-1]) if placed else (len(nodes), -1)
    out: dict[Node, str] = {}
    current = "pre"
    for i, n in enumerate(nodes):
        if owner[n] is not None:
            current = owner[n]
        out[n] = owner[n] or ("pre" if i < first else "post" if i > last else current)
    return out


def _is_graph_module_call(node: Node, root: nn.Module, instrumented: set[int]) -> bool:
    """A call_module of a GraphModule that gets its own regions: the caller leaves it out of its blocks."""
    if node.op != "call_module":
        return False
    try:
        return id(root.get_submodule(str(node.target))) in instrumented
    except AttributeError:
        return False


def instrumented_graph(gm: GraphModule, layers: Sequence[str],
                       instrumented: Iterable[int] = ()) -> tuple[fx.Graph, dict[Node, Node]]:
    """A copy of gm's graph with a record_function region around each block's nodes and each collective; and
    each copied node's original."""
    blocks = node_blocks(gm.graph, layers)
    inside = set(instrumented)
    for n in list(blocks):
        if _is_graph_module_call(n, gm, inside):
            blocks[n] = ""  # no region of its own: its graph has them (a HybridModel stage's block)
    graph = fx.Graph()
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    env: dict[Node, Node] = {}
    open_block: Optional[tuple[str, Node]] = None
    for node in gm.graph.nodes:
        label = blocks.get(node)
        if node.op == "output" or (label is not None and (open_block is None or open_block[0] != label)):
            if open_block is not None:
                graph.call_function(_exit, (open_block[1],))
                open_block = None
            if label:
                open_block = (label, graph.call_function(_enter, (BLOCK + label, None)))
        op = collective_target(node)
        if op is None:
            env[node] = graph.node_copy(node, lambda n: env[n])
            continue
        source = node.args[0] if node.args else None  # a tensor, or a list of them (a gradient bucket)
        first = next(iter(pytree.tree_leaves(source)), None)
        where = module_path(node) or (module_path(first) if isinstance(first, Node) else "")
        tag = f"{op} @ {where or '-'} ({node.name})"
        handle = graph.call_function(enter_collective, (fx.node.map_arg(source, lambda n: env[n]), tag))
        env[node] = graph.node_copy(node, lambda n: env[n])
        graph.call_function(_exit, (handle,))
    return graph, {copy_: original for original, copy_ in env.items()}


def _forward_of(graph: fx.Graph, origin: dict[Node, Node], module: GraphModule) -> tuple[Callable[..., Any], dict]:
    """The graph's generated code as a forward method bound to `module`, and its line -> original node index map
    (runtime/failures.py reads a failing collective's node off the running line)."""
    from torch.fx.graph_module import _forward_from_src
    code = graph.python_code(root_module="self")
    nodes, index = list(graph.nodes), {n: i for i, n in enumerate(module.graph.nodes)}
    lines = {line: index.get(origin.get(nodes[i])) if i is not None else None
             for line, i in (code._lineno_map or {}).items()}
    return types.MethodType(_forward_from_src(code.src, code.globals), module), lines


def graph_slot(gm: Any) -> Any:
    """gm's instance-level forward when it runs gm's own graph through a settable `graph_forward` (a rank
    module's re-sharding dispatch, runtime/shape_cache.py), else None."""
    forward = getattr(gm, "__dict__", {}).get("forward")
    return forward if forward is not None and hasattr(forward, "graph_forward") else None


def graph_modules(root: Any) -> list[GraphModule]:
    """The GraphModules a rank module or a HybridModel runs (each stage, and the blocks inside it)."""
    tops = list(root.stages.values()) if hasattr(root, "stages") else [root]
    for top in list(tops):  # a rank module's captures for other input shapes, made so far
        slot = graph_slot(top)
        tops.extend(slot.graphs() if slot is not None and hasattr(slot, "graphs") else ())
    seen: dict[int, GraphModule] = {}
    for top in tops:
        for m in top.modules():
            if isinstance(m, GraphModule):
                seen.setdefault(id(m), m)
    return list(seen.values())


@dataclass
class Installed:
    """What install did: how to undo it, the layers it cut blocks at, each block's modules, modules left alone."""

    undo: Callable[[], None]
    layers: list[str]
    modules: dict[str, list[str]]
    skipped: int


def block_modules(gms: Iterable[GraphModule], layers: Sequence[str]) -> dict[str, list[str]]:
    """Block -> the module paths of its nodes, in graph order (a layer: itself)."""
    out: dict[str, list[str]] = {}
    for gm in gms:
        for node, block in node_blocks(gm.graph, layers).items():
            paths = out.setdefault(block, [])
            if node.op == "call_module" and block not in layers:
                continue  # the capture's input guards, called as modules of their own
            path = block if block in layers else module_path(node)
            if path and path not in paths:
                paths.append(path)
    return out


def _pipeline_waits() -> Callable[[], None]:
    """Time each wait of torch's pipeline schedules for its peers' sends in a region of its own; the undo."""
    from torch.distributed.pipelining import schedules
    original = schedules._wait_batch_p2p

    def wait(work: Any) -> Any:
        """torch's wait, inside its region."""
        with torch.profiler.record_function(PIPELINE + "wait"):
            return original(work)

    schedules._wait_batch_p2p = wait

    def undo() -> None:
        """Put torch's own wait back."""
        if schedules._wait_batch_p2p is wait:
            schedules._wait_batch_p2p = original

    return undo


def install(root: Any, layers: Optional[Sequence[str]] = None) -> Installed:
    """Give every GraphModule of `root` its instrumented forward.

    A rank module whose forward dispatches calls at other input shapes (graph_slot) keeps that
    dispatch and runs the instrumented code for its own graph; captures it makes inside the block
    run uninstrumented. Any other module whose forward is already an instance attribute (a block
    under activation checkpointing wraps its forward so) keeps it: its time counts, its
    collectives go unnamed.
    """
    gms = graph_modules(root)
    if layers is None:
        layers = repeated_layers(gm.graph for gm in gms)
    mine = [gm for gm in gms if "forward" not in gm.__dict__ or graph_slot(gm) is not None]
    ids = {id(gm) for gm in mine}
    forwards = [(gm, *_forward_of(*instrumented_graph(gm, layers, ids), gm), gm.__dict__.get("_lineno_map"),
                 graph_slot(gm)) for gm in mine]
    kept = [slot.graph_forward if slot is not None else None for *_, slot in forwards]
    for gm, fwd, lines, _, slot in forwards:
        if slot is not None:
            slot.graph_forward = fwd
        else:
            gm.forward = fwd
        gm._lineno_map = lines
    # a HybridModel's stages wait for each other inside torch's schedule, out of every graph: the bubble
    unwait = _pipeline_waits() if hasattr(root, "stages") else (lambda: None)

    def undo() -> None:
        """Give every module its own forward (and line map) back."""
        unwait()
        for (gm, fwd, _, lines, slot), before in zip(forwards, kept):
            if slot is not None and slot.graph_forward is fwd:
                slot.graph_forward = before
                gm._lineno_map = lines
            elif slot is None and gm.__dict__.get("forward") is fwd:
                del gm.__dict__["forward"]
                gm._lineno_map = lines

    return Installed(undo, list(layers), block_modules(mine, layers), len(gms) - len(mine))
