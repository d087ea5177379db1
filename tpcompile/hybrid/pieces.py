"""Cut the captured graph into pieces at the model's repeated blocks, each piece its own GraphModule.

A piece is the code before the first block ("pre"), one block (e.g. "transformer.h.3"), code
between two blocks ("glue.3") or after the last ("post"). Every captured node belongs to one
piece: a node traced inside a block's module belongs to it, any other node to the root piece
at its position. A piece graph's inputs are only the real activations it needs from other
pieces (and the model inputs); sizes and values computed from sizes and buffers alone (a
causal mask, rotary cos/sin, position ids) are recomputed inside every piece that uses them,
so pipeline stages exchange nothing but activations. Parameters keep their original dotted
names, so each piece can be sharded by tpcompile on its own and loaded from the model's weights.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import fx, nn
from torch.fx import GraphModule, Node

from tpcompile.errors import TPCompileError

aten = torch.ops.aten


@dataclass
class Piece:
    """One piece of the captured graph and the values it exchanges with the others."""

    name: str  # "pre", "post", "glue.<i>", or the block's module path
    block: bool  # True: a repeated block, later a called submodule owning its parameters
    nodes: list[Node] = field(default_factory=list)  # captured nodes, in graph order
    inputs: list[Node] = field(default_factory=list)  # captured values received, in placeholder order
    outputs: list[Node] = field(default_factory=list)  # captured values handed on, in output order
    gm: Optional[GraphModule] = None  # the piece as a graph of its own (absolute parameter names)


def find_blocks(model: nn.Module) -> list[str]:
    """Module paths of the model's repeated blocks: the largest ModuleList/Sequential of one layer type."""
    best: tuple[int, list[str]] = (0, [])
    for name, mod in model.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)):
            continue
        kids = list(mod.named_children())
        if len(kids) < 2 or len({type(m) for _, m in kids}) != 1:
            continue
        size = sum(p.numel() for p in mod.parameters())
        if size > best[0]:
            best = (size, [f"{name}.{k}" if name else k for k, _ in kids])
    return best[1]


def _block_of(node: Node, blocks: list[str]) -> Optional[int]:
    """Index of the block whose module traced `node`, if any."""
    stack = node.meta.get("nn_module_stack") or {}
    for entry in stack.values():
        path = entry[0] if isinstance(entry, tuple) else ""
        for i, b in enumerate(blocks):
            if path == b or path.startswith(b + "."):
                return i
    return None


def _assign(gm: GraphModule, blocks: list[str]) -> list[Piece]:
    """Every computing node put in a piece: its block's, else the root piece at its position."""
    body = [n for n in gm.graph.nodes if n.op == "call_function"]
    owner = {n: _block_of(n, blocks) for n in body}
    last = {}
    for i, n in enumerate(body):
        if owner[n] is not None:
            last[owner[n]] = i
    pieces: list[Piece] = []
    by_key: dict[Any, Piece] = {}
    current: Optional[int] = None  # the block whose span we are in, if any
    key_of: dict[Node, Any] = {}
    for i, n in enumerate(body):
        b = owner[n]
        if b is None and current is not None and last[current] > i:
            b = current  # an untraced helper node inside a block's span belongs to the block
        if n.target is operator.getitem and isinstance(n.args[0], Node) and n.args[0] in key_of:
            key: Any = key_of[n.args[0]]  # an element of a multi-output op stays with it: tuples never cross
        elif b is not None:
            current = b
            key = b
        elif current is None:
            key = "pre"
        else:
            key = "post" if current == max(last) else f"glue.{current}"
        key_of[n] = key
        if key not in by_key:
            name = blocks[key] if isinstance(key, int) else key
            by_key[key] = Piece(name, isinstance(key, int))
            pieces.append(by_key[key])
        by_key[key].nodes.append(n)
    return pieces


def size_only_values(gm: GraphModule) -> set[Node]:
    """Values computed from sizes and non-parameter buffers alone (recomputable in any piece).

    One pass in graph order: a value is size-only when every input is (a sym_size of anything is;
    a placeholder's tensor or a parameter never is).
    """
    params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    out: set[Node] = set()
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            if n.target not in params:
                out.add(n)
        elif n.op == "call_function" and (n.target is aten.sym_size.int or all(a in out for a in n.all_input_nodes)):
            out.add(n)
    return out


def _wire(pieces: list[Piece], output: Node, size_only: set[Node]) -> None:
    """Each piece's inputs (activations from elsewhere) and outputs (what others or the model need)."""
    home = {n: p for p in pieces for n in p.nodes}
    needed: dict[int, list[Node]] = {id(p): [] for p in pieces}
    for p in pieces:
        mine = set(p.nodes)
        for n in p.nodes:
            for a in n.all_input_nodes:
                if a in mine or a.op == "get_attr" or a in size_only or a in p.inputs:
                    continue
                p.inputs.append(a)
                if a in home and a not in needed[id(home[a])]:
                    needed[id(home[a])].append(a)
    for a in output.all_input_nodes:
        if a in home and a not in needed[id(home[a])]:
            needed[id(home[a])].append(a)
    for p in pieces:
        p.outputs = sorted(needed[id(p)], key=p.nodes.index)


def _size_of(graph: fx.Graph, want: Node, sources: list[Node]) -> Node:
    """A sym_size node in `graph` giving the symbolic size `want` has, read off one of `sources`."""
    expr = want.meta["val"].node.expr if isinstance(want.meta.get("val"), torch.SymInt) else None
    for ph in sources:
        val = ph.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for d, s in enumerate(val.shape):
            if isinstance(s, torch.SymInt) and expr is not None and s.node.expr == expr:
                node = graph.call_function(aten.sym_size.int, (ph, d))
                node.meta["val"] = want.meta["val"]
                return node
    raise TPCompileError(f"a piece of the split graph needs the size {expr} ({want.name}) but none of its "
                         f"inputs has a dimension of that size; pipeline stages must each receive a "
                         f"tensor carrying every batch/sequence size they use")


def canonical_names(gm: GraphModule) -> dict[str, str]:
    """Every parameter or buffer name -> the first name of the same tensor (tied weights share one)."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    named = list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False))
    for name, t in named:
        out[name] = first.setdefault(id(t), name)
    return out


def build_piece_graph(root: GraphModule, piece: Piece, canon: dict[str, str]) -> GraphModule:
    """The piece as a GraphModule: its inputs as placeholders, its outputs as a tuple; a tied
    parameter is read under its first name in every piece."""
    graph = fx.Graph()
    env: dict[Node, Node] = {}
    for i, a in enumerate(piece.inputs):
        ph = graph.placeholder(a.name if a.op == "placeholder" else f"in_{a.name}")
        ph.meta.update({k: v for k, v in a.meta.items() if k in ("val", "tensor_meta")})
        env[a] = ph
    sources = list(env.values())

    def bring(n: Node) -> Node:
        """n's value inside this graph: copied (recomputed from sizes and buffers) when it lives elsewhere."""
        if n not in env:
            if n.op == "get_attr":
                env[n] = graph.get_attr(canon.get(n.target, n.target))
                env[n].meta = dict(n.meta)
            elif n.op == "call_function" and n.target is aten.sym_size.int and n.args[0] not in env:
                env[n] = _size_of(graph, n, sources)
            else:
                env[n] = graph.node_copy(n, bring)
        return env[n]

    for n in piece.nodes:
        env[n] = graph.node_copy(n, bring)
    graph.output(tuple(env[o] for o in piece.outputs))
    graph.eliminate_dead_code()
    gm = GraphModule(root, graph, class_name="Piece")
    gm.meta["piece"] = piece.name
    return gm


def split_pieces(gm: GraphModule, blocks: list[str]) -> list[Piece]:
    """The captured graph cut into pieces (see the module docstring), each with its own GraphModule."""
    for n in list(gm.graph.nodes):  # the captured input guards check the whole model's inputs only
        if n.op == "call_module" and n.target == "_guards_fn":
            gm.graph.erase_node(n)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    pieces = _assign(gm, blocks)
    _wire(pieces, output, size_only_values(gm))
    canon = canonical_names(gm)
    for p in pieces:
        p.gm = build_piece_graph(gm, p, canon)
    return [p for p in pieces if p.outputs or p.block]


def output_leaves(gm: GraphModule) -> list[Any]:
    """The captured graph's flat output values (nodes, or constants the model returns)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    leaves = output.args[0]
    return list(leaves) if isinstance(leaves, (tuple, list)) else [leaves]

