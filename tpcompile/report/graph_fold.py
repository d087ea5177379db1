"""Plumbing folded for the picture: a run of nodes that read no weight (masks, positions, rotary tables) as one box.

A model's activations flow from its weights (and its float inputs); what is computed beside them from
the inputs' sizes, token ids and buffers alone, such as a causal mask or the cos/sin tables of rotary
embeddings, can fill the top of a picture with dozens of replicated boxes. Each connected run of at
least MIN_FOLD such nodes becomes one box named by the values it hands on; nodes.txt still lists every
node, and the box's tooltip names them. Nodes the rewrite added (no placement) and collectives are
never folded: they are what a rank's picture is for.
"""
from __future__ import annotations

import heapq
from typing import Sequence

from tpcompile.report.node_table import NodeInfo

MIN_FOLD = 8
_FOLDABLE = ("replicated", "shard", "param")  # not: inputs, sizes, outputs, collectives, partial sums, new nodes
_FLOAT_WORDS = ("float", "bfloat16", "half", "double", "complex")


def _is_float_input(info: NodeInfo) -> bool:
    """A placeholder whose traced dtype is floating point (a model's features, not its token ids)."""
    dtype = info.shape.split(" ")[-1] if info.shape else ""
    return info.op == "placeholder" and any(w in dtype for w in _FLOAT_WORDS)


def _main(infos: Sequence[NodeInfo]) -> set[str]:
    """The nodes that depend on a weight or a float input: the model's activations and everything after them."""
    main = {i.name for i in infos if i.weight or _is_float_input(i)}
    for i in infos:  # graph order is topological
        if any(x in main for x in i.inputs):
            main.add(i.name)
    return main


def _components(names: set[str], infos: Sequence[NodeInfo]) -> list[list[str]]:
    """The connected runs of `names` (edges between two of them), each in graph order."""
    parent = {n: n for n in names}

    def root(n: str) -> str:
        """The representative of n's run (path halving)."""
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for i in infos:
        if i.name in names:
            for x in i.inputs:
                if x in names:
                    parent[root(x)] = root(i.name)
    runs: dict[str, list[str]] = {}
    for i in infos:
        if i.name in names:
            runs.setdefault(root(i.name), []).append(i.name)
    return list(runs.values())


def _folded(run: list[str], results: list[str], by: dict[str, NodeInfo]) -> NodeInfo:
    """One box for a run, named by its results (unique: they are its own members); every member listed in its
    target (the tooltip), its outside inputs as its inputs; its shape field says how many nodes it holds."""
    members = set(run)
    inputs = tuple(dict.fromkeys(x for n in run for x in by[n].inputs if x not in members))
    modules = {by[n].module for n in run}
    return NodeInfo(", ".join(results), "folded", ", ".join(run), "", "folded", f"{len(run)} nodes",
                    modules.pop() if len(modules) == 1 else "", inputs, False)


def fold_plumbing(infos: Sequence[NodeInfo]) -> tuple[list[NodeInfo], dict[str, list[str]]]:
    """The nodes with each long run of weight-free plumbing replaced by one box (in a topological order), and
    for each box the names of the values it hands on."""
    if not any(i.weight for i in infos):
        return list(infos), {}
    by = {i.name: i for i in infos}
    main = _main(infos)
    users: dict[str, list[str]] = {}
    for i in infos:
        for x in i.inputs:
            users.setdefault(x, []).append(i.name)
    candidates = {i.name for i in infos if i.name not in main and i.kind in _FOLDABLE
                  and i.op in ("call_function", "get_attr") and not i.weight}
    # checks that only read plumbing (torch.export's _assert_tensor_metadata) go with it: nothing reads them
    candidates |= {i.name for i in infos if i.op == "call_function" and i.kind not in ("collective", "size")
                   and not users.get(i.name) and i.inputs and all(x in candidates for x in i.inputs)}
    owner: dict[str, str] = {}
    boxes: dict[str, NodeInfo] = {}
    handed: dict[str, list[str]] = {}
    for run in _components(candidates, infos):
        members = set(run)
        outside = {u for n in run for u in users.get(n, []) if u not in members}
        if len(run) < MIN_FOLD or not outside or all(by[u].op == "output" for u in outside):
            continue
        results = [n for n in run if any(u not in members for u in users.get(n, []))]
        box = _folded(run, results, by)
        boxes[box.name] = box
        handed[box.name] = results
        owner.update({n: box.name for n in run})
    if not boxes:
        return list(infos), {}
    return _in_order(infos, owner, boxes), handed


def _in_order(infos: Sequence[NodeInfo], owner: dict[str, str], boxes: dict[str, NodeInfo]) -> list[NodeInfo]:
    """The graph with folded nodes replaced by their box and edges redirected, sorted topologically with the
    original order as the tie-break (a box waits for its last outside input)."""
    rows: list[NodeInfo] = []
    index: dict[str, int] = {}
    for i in infos:
        name = owner.get(i.name, i.name)
        if name in index:
            continue
        info = boxes.get(name) or i
        inputs = tuple(dict.fromkeys(owner.get(x, x) for x in info.inputs if owner.get(x, x) != name))
        index[name] = len(rows)
        rows.append(NodeInfo(info.name, info.op, info.target, info.placement, info.kind, info.shape, info.module,
                             inputs, info.weight))
    waiting = {r.name: {x for x in r.inputs if x in index} for r in rows}
    after: dict[str, list[str]] = {}
    for r in rows:
        for x in waiting[r.name]:
            after.setdefault(x, []).append(r.name)
    ready = [index[r.name] for r in rows if not waiting[r.name]]
    heapq.heapify(ready)
    out: list[NodeInfo] = []
    while ready:
        r = rows[heapq.heappop(ready)]
        out.append(r)
        for u in after.get(r.name, []):
            waiting[u].discard(r.name)
            if not waiting[u]:
                heapq.heappush(ready, index[u])
    return out
