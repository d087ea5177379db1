"""The block chain as a networkx graph with cost attributes, and its optimal split into pipeline stages.

`block_graph` holds one node per block (per-microbatch time, parameter and activation bytes)
and one edge per boundary (activation bytes handed on). `partition` cuts the chain into
exactly p contiguous stages with a shortest path over cut points: the nodes of a second graph
are (blocks covered, stages used), an edge (i, s) -> (j, s + 1) is "stage s runs blocks i..j-1",
present only when that stage fits in memory with its in-flight microbatches. A 1F1B step takes
about (m - 1) x the slowest stage + the sum of all stages, and the sum hardly depends on the cut,
so the best cut minimises the slowest stage first, then the next slowest, and so on: edge
weights are (p + 1) ** rank(stage time), which makes a path's total compare as its sorted
stage times do (a path has at most p edges). Edges slower than a known feasible cut are left
out, which keeps the graph small without losing the optimum.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence

if TYPE_CHECKING:  # networkx is imported when a plan is made, not with tpcompile
    import networkx as nx

StageMemory = Callable[[int, int, int], float]  # (first block, end block, stage index) -> bytes


@dataclass(frozen=True)
class Partition:
    """Stages as [start, end) block ranges, with each stage's time and memory."""

    bounds: tuple[tuple[int, int], ...]
    times: tuple[float, ...]
    memory: tuple[float, ...]

    @property
    def slowest(self) -> float:
        return max(self.times)


def block_graph(names: Sequence[str], times: Sequence[float], params: Sequence[float], acts: Sequence[float],
                send_bytes: Sequence[float], send_s: Sequence[float]) -> nx.DiGraph:
    """The chain: node attributes time (s per microbatch), params and act (bytes per rank); edge
    attributes bytes (activations handed on per microbatch) and send_s (their send and the gradient's return)."""
    import networkx as nx
    g = nx.DiGraph()
    for i, name in enumerate(names):
        g.add_node(name, index=i, time=times[i], params=params[i], act=acts[i])
    for i in range(len(names) - 1):
        g.add_edge(names[i], names[i + 1], bytes=send_bytes[i], send_s=send_s[i])
    return g


def _stage_time(prefix: list[float], send: Sequence[float], i: int, j: int) -> float:
    """Blocks i..j-1 plus the activation send after the last of them (none for the last stage)."""
    return prefix[j] - prefix[i] + (send[j - 1] if j < len(send) else 0.0)


def _even_bound(prefix: list[float], send: Sequence[float], stages: int) -> float:
    """The slowest stage of a cut at equal shares of the total time (an upper bound on the optimum)."""
    n = len(prefix) - 1
    cuts = [0]
    for s in range(1, stages):
        target = prefix[n] * s / stages
        k = bisect.bisect_left(prefix, target, lo=cuts[-1] + 1)
        cuts.append(min(max(k, cuts[-1] + 1), n - (stages - s)))
    cuts.append(n)
    return max(_stage_time(prefix, send, a, b) for a, b in zip(cuts, cuts[1:]))


def partition(graph: nx.DiGraph, stages: int, memory: Optional[StageMemory] = None,
              capacity: float = float("inf")) -> Optional[Partition]:
    """The best cut of the block chain into `stages` stages that each fit `capacity`; None if none fits."""
    import networkx as nx
    nodes = sorted(graph.nodes(data=True), key=lambda x: x[1]["index"])
    times = [d["time"] for _, d in nodes]
    names = [name for name, _ in nodes]
    send = [graph.edges[a, b]["send_s"] for a, b in zip(names, names[1:])] + [0.0]
    n = len(times)
    if stages < 1 or stages > n:
        return None
    prefix = [0.0]
    for t in times:
        prefix.append(prefix[-1] + t)
    mem = memory or (lambda i, j, s: 0.0)
    bound = _even_bound(prefix, send, stages)
    even_fits = True  # the bound only prunes when the even cut is itself feasible
    if memory is not None:
        even_fits = _fits_even(prefix, send, stages, mem, capacity)
    limit = bound * (1 + 1e-9) if even_fits else float("inf")
    cut = nx.DiGraph()
    frontier = {0}
    costs: list[tuple[tuple[int, int], tuple[int, int], float, float]] = []
    for s in range(stages):
        nxt: set[int] = set()
        for i in frontier:
            last = n - (stages - s - 1)  # leave at least one block for each later stage
            for j in range(i + 1, last + 1):
                if s == stages - 1 and j != n:
                    continue
                t = _stage_time(prefix, send, i, j)
                if t > limit:
                    break  # stage times only grow with j
                m = mem(i, j, s)
                if m > capacity:
                    continue
                costs.append(((i, s), (j, s + 1), t, m))
                nxt.add(j)
        frontier = nxt
    if not costs:
        return None
    ranks = {v: r for r, v in enumerate(sorted({round(c[2], 12) for c in costs}))}
    base = stages + 1
    for a, b, t, m in costs:
        cut.add_edge(a, b, weight=base ** ranks[round(t, 12)], time=t, memory=m)
    if (n, stages) not in cut:
        return None
    try:
        path = nx.dijkstra_path(cut, (0, 0), (n, stages), weight="weight")
    except nx.NetworkXNoPath:
        return None
    edges = [cut.edges[a, b] for a, b in zip(path, path[1:])]
    bounds = tuple((a[0], b[0]) for a, b in zip(path, path[1:]))
    return Partition(bounds, tuple(e["time"] for e in edges), tuple(e["memory"] for e in edges))


def _fits_even(prefix: list[float], send: Sequence[float], stages: int, mem: StageMemory, capacity: float) -> bool:
    """Whether the equal-share cut fits in memory (then its slowest stage may bound the search)."""
    n = len(prefix) - 1
    cuts = [0]
    for s in range(1, stages):
        k = bisect.bisect_left(prefix, prefix[n] * s / stages, lo=cuts[-1] + 1)
        cuts.append(min(max(k, cuts[-1] + 1), n - (stages - s)))
    cuts.append(n)
    return all(mem(a, b, s) <= capacity for s, (a, b) in enumerate(zip(cuts, cuts[1:])))
