"""The block chain as a networkx graph with cost attributes, and its optimal split into pipeline stages.

`block_graph` holds one node per block (per-microbatch time, parameter and activation bytes)
and one edge per boundary (activation bytes handed on). `partition` cuts the chain into
exactly p contiguous stages with a shortest path over cut points: the nodes of a second graph
are (blocks covered, stages used), an edge (i, s) -> (j, s + 1) is "stage s runs blocks i..j-1",
present only when that stage fits in memory with its in-flight microbatches. A 1F1B step takes
about (m - 1) x the slowest stage + the sum of all stages, and the sum hardly depends on the cut,
so the best cut minimises the slowest stage first, then the next slowest, and so on: a path's
length is its stage times sorted slowest first, compared as tuples (as edge weights of
(p + 1) ** rank(stage time) would compare, a path having at most p edges). Dijkstra builds that
graph as it walks it, and asks for a stage's memory only when the stage would give the shortest
path yet to its end. Stages slower than a known feasible cut are left out, which keeps the graph
small without losing the optimum.
"""
from __future__ import annotations

import bisect
import heapq
import itertools
import operator
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

    source, target = (0, 0), (n, stages)
    order = itertools.count()
    fringe: list = [((), next(order), source)]
    seen: dict[tuple[int, int], tuple] = {source: ()}
    done: set[tuple[int, int]] = set()
    how: dict[tuple[int, int], tuple] = {}  # node -> (previous node, stage time, stage memory) on its best path
    while fringe:
        length, _, v = heapq.heappop(fringe)
        if v in done:
            continue
        done.add(v)
        if v == target:
            break
        i, s = v
        start = prefix[i]
        # stage s runs blocks i..j-1, leaving at least one block for each later stage
        for j in (n,) if s == stages - 1 else range(i + 1, n - (stages - s - 1) + 1):
            t = prefix[j] - start + (send[j - 1] if j < n else 0.0)  # _stage_time(prefix, send, i, j)
            if t > limit:
                break  # stage times only grow with j
            u = (j, s + 1)
            if u in done:
                continue
            longer = _with(length, round(t, 12))
            # the stage's memory matters only to a path that would be the shortest yet to its end
            if (u not in seen or longer < seen[u]) and (m := mem(i, j, s)) <= capacity:
                seen[u] = longer
                heapq.heappush(fringe, (longer, next(order), u))
                how[u] = (v, t, m)
    if target not in done:
        return None
    cut = []  # the stages (start, end, time, memory), last first
    node = target
    while node != source:
        prev, t, m = how[node]
        cut.append((prev[0], node[0], t, m))
        node = prev
    cut.reverse()
    return Partition(tuple((i, j) for i, j, _, _ in cut), tuple(c[2] for c in cut), tuple(c[3] for c in cut))


def _with(length: tuple, t: float) -> tuple:
    """A path length (stage times, slowest first) with one more stage."""
    k = bisect.bisect_left(length, -t, key=operator.neg)
    return length[:k] + (t,) + length[k:]


def _fits_even(prefix: list[float], send: Sequence[float], stages: int, mem: StageMemory, capacity: float) -> bool:
    """Whether the equal-share cut fits in memory (then its slowest stage may bound the search)."""
    n = len(prefix) - 1
    cuts = [0]
    for s in range(1, stages):
        k = bisect.bisect_left(prefix, prefix[n] * s / stages, lo=cuts[-1] + 1)
        cuts.append(min(max(k, cuts[-1] + 1), n - (stages - s)))
    cuts.append(n)
    return all(mem(a, b, s) <= capacity for s, (a, b) in enumerate(zip(cuts, cuts[1:])))
