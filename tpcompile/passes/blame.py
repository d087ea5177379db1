"""Which seeds a conflict blames: of several origins, those no other of them feeds (passes/sweep.py `judge`)."""
from __future__ import annotations


def upstream(seeds: frozenset) -> frozenset:
    """The seeds no other of them feeds: a split downstream of another blamed one may only be a consequence of
    it (a projection into the residual stream makes the next layer's q/k/v row splits, so its output
    projection a column split) and is judged again once that one is whole."""
    if len(seeds) < 2:
        return seeds
    keep = set()
    for seed in seeds:
        todo, seen, fed = list(seed.all_input_nodes), set(), False
        while todo and not fed:  # the seed's ancestors, until another seed is among them
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                fed = n in seeds
                todo += n.all_input_nodes
        if not fed:
            keep.add(seed)
    return frozenset(keep) or seeds
