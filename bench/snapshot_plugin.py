"""A pytest plugin that writes what every ShardedModel a test makes decided and emitted, to check that a refactor of
the passes is behaviour-preserving on the whole suite.

    SNAPSHOT_DIR=/tmp/before python -m pytest -q -n 2 -p bench.snapshot_plugin
    (change the code)
    SNAPSHOT_DIR=/tmp/after python -m pytest -q -n 2 -p bench.snapshot_plugin
    diff -r /tmp/before /tmp/after

One file per test: per ShardedModel, each node's placement, rule and layout (as text), each parameter's cut (its
DimLayout) and local shape, then the code of every rank graph the test builds. Ranks built from several threads
may be written in another order (compare the sections, not the order, for those).
"""
from __future__ import annotations

import os
import re
from typing import Any

from tpcompile import api
from tpcompile.layouts import dim_layout

_DIR = os.environ.get("SNAPSHOT_DIR", "snapshot")
_count: dict[str, int] = {}
_init, _rank = api.ShardedModel.__init__, api.ShardedModel.rank


def _key() -> str:
    test = os.environ.get("PYTEST_CURRENT_TEST", "none").rsplit(" ", 1)[0]
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", test)[:180]


def _write(text: str) -> None:
    os.makedirs(_DIR, exist_ok=True)
    with open(os.path.join(_DIR, _key() + ".txt"), "a") as f:
        f.write(text + "\n")


def _placement(p: Any) -> str:
    return "(" + ", ".join(map(str, p)) + ")" if isinstance(p, tuple) else str(p)


def _layout(layout: Any) -> str:
    if layout is None:
        return "-"
    wants = ",".join(f"{w.node.name}:{w.placement}:{int(w.grad_sync)}" for w in layout.wants)
    return f"{layout.role} [{wants}] {layout.localize} {layout.gather_output}"


def _cut(sl: Any, full: int, ws: int) -> str:
    if sl is None:
        return "whole"
    segments = dim_layout(sl, full, ws).segments
    return f"dim {sl.dim} " + " ".join(f"{s.size}:{','.join(map(str, s.cuts))}" for s in segments)


def describe(sm: Any) -> str:
    """The decision of one ShardedModel as text: placements, rules, layouts, cuts, local shapes."""
    decided = sm.decisions
    lines = [f"=== sm {sm._snapshot_id} {sm.model_name} ws {decided.world_size}"]
    for node, d in decided.nodes.items():
        rule = getattr(d.rule, "rule", d.rule)
        lines.append(f"{node.graph is sm.captured.graph} {node.name}: {_placement(d.placement)} | {rule} | "
                     f"{_layout(d.layout)}")
    for name in sorted(decided.cuts):
        sl = decided.cuts[name]
        full = None if sl is None else decided.tensors[name].shape[sl.dim]
        lines.append(f"cut {name}: {_cut(sl, full, decided.world_size)}")
    lines += [f"plan {name}: {pp.local_shape}" for name, pp in sorted(sm.plan.parameters.items())]
    return "\n".join(lines)


def _patched_init(self: Any, *args: Any, **kwargs: Any) -> None:
    _init(self, *args, **kwargs)
    key = _key()
    _count[key] = _count.get(key, 0) + 1
    self._snapshot_id = _count[key]
    _write(describe(self))


def _patched_rank(self: Any, r: int) -> Any:
    new = r not in self._ranks
    try:
        gm = _rank(self, r)
    except Exception as e:
        _write(f"=== sm {getattr(self, '_snapshot_id', '?')} rank {r} error {type(e).__name__}: {str(e)[:2000]}")
        raise
    if new:
        _write(f"=== sm {getattr(self, '_snapshot_id', '?')} rank {r}\n{gm.code}")
    return gm


api.ShardedModel.__init__ = _patched_init
api.ShardedModel.rank = _patched_rank
