"""The profiling pass: block and collective regions in a copy of each rank graph, the ranks' results unchanged."""
from __future__ import annotations

import functools
import linecache
import warnings
from collections import Counter
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from conftest import max_diff
from torch import nn

import tpcompile
from tpcompile.models import GPT, GPTConfig
from tpcompile.ops.schedule import collective_op
from tpcompile.runtime import profiler_marks
from tpcompile.runtime.profiler_marks import (BLOCK, COLLECTIVE, enter_collective, install, instrumented_graph,
                                              node_blocks, repeated_layers)
from tpcompile.runtime.shape_cache import install_reshard, share_tensors

LAYERS = ["transformer.h.0", "transformer.h.1"]


@functools.cache
def _sharded() -> tuple[tpcompile.ShardedModel, torch.Tensor]:
    """A tiny GPT sharded over 2 ranks, and its token ids."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)).eval()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    return tpcompile.shard(model, 2, example_inputs=(ids,)), ids


def test_layers_and_blocks_follow_the_planner() -> None:
    """The repeated layers come from the nodes' module stacks; embeddings are 'pre', the head 'post'."""
    sm, _ = _sharded()
    gm = sm.rank(0)
    assert repeated_layers([gm.graph]) == LAYERS
    blocks = node_blocks(gm.graph, LAYERS)
    assert list(dict.fromkeys(blocks.values())) == ["pre", *LAYERS, "post"]


def test_every_block_and_collective_gets_one_region() -> None:
    """One region per block and per collective node, each opened once and closed once."""
    sm, _ = _sharded()
    gm = sm.rank(0)
    graph, origin = instrumented_graph(gm, LAYERS)
    enters = [n for n in graph.nodes if "record_function_enter" in str(n.target) or n.target is enter_collective]
    exits = [n for n in graph.nodes if "record_function_exit" in str(n.target)]
    collectives = [n for n in gm.graph.nodes if collective_op(n)]
    names = [n.args[0] for n in enters if isinstance(n.args[0], str)]
    assert names == [BLOCK + b for b in ["pre", *LAYERS, "post"]]
    assert len(enters) == len(exits) == len(names) + len(collectives)
    assert all(origin[n] in collectives for n in graph.nodes if collective_op(n))


def test_installed_forward_computes_the_same_and_is_undone() -> None:
    """With the regions installed every simulated rank returns what it did without them; undo removes them."""
    sm, ids = _sharded()
    ranks = [sm.rank(r) for r in range(2)]
    plain = tpcompile.simulate_ranks(2, lambda r: ranks[r](ids))
    done = [install(gm, LAYERS) for gm in ranks]
    assert all("forward" in gm.__dict__ for gm in ranks) and done[0].layers == LAYERS
    marked = tpcompile.simulate_ranks(2, lambda r: ranks[r](ids))
    for d in done:
        d.undo()
    assert all("forward" not in gm.__dict__ for gm in ranks)
    assert all(torch.equal(a, b) for a, b in zip(plain, marked))


def test_failure_lines_name_the_original_node() -> None:
    """While installed, the line map the failure messages read sends a collective's line to its own node."""
    sm, _ = _sharded()
    gm = sm.rank(0)
    done = install(gm, LAYERS)
    try:
        code = gm.forward.__func__.__code__
        source = linecache.getlines(code.co_filename)
        nodes = list(gm.graph.nodes)
        hits = [i for i, line in enumerate(source, start=1) if "torch.ops.tpcompile.all_reduce" in line]
        assert hits
        for line in hits:
            node = nodes[gm._lineno_map[line - code.co_firstlineno]]
            assert collective_op(node) == "all_reduce", node.format_node()
    finally:
        done.undo()


class LengthMLP(nn.Module):
    """A column-then-row MLP plus a per-position table built in Python (it fixes dim 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = torch.tensor([float(t) for t in range(x.shape[1])])
        return self.down(F.relu(self.up(x))) + table[:, None]


@pytest.mark.parametrize("comm", [None, False])
def test_a_rank_modules_shape_dispatch_is_kept_and_runs_the_regions(monkeypatch: pytest.MonkeyPatch,
                                                                     comm: Optional[bool]) -> None:
    """On rank modules that re-shard refused shapes, install fills the dispatch's graph_forward and instruments the
    captures made so far; both lengths equal the model with every all-reduce in a region; undo puts all back."""
    torch.manual_seed(0)
    model = LengthMLP().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, 2, example_inputs=(torch.randn(2, 4, 8),), comm=comm)
    ranks = [sm.rank(r) for r in range(2)]
    for r, gm in enumerate(ranks):  # as tpcompile.parallelize leaves its rank module
        install_reshard(gm, sm.shapes, r, lambda new, i: share_tensors(new.rank(i), ranks[i], sm.shapes.names))
    dispatch = [gm.__dict__["forward"] for gm in ranks]
    regions: list[str] = []
    enter = profiler_marks._enter
    monkeypatch.setattr(profiler_marks, "_enter", lambda name, args: regions.append(name) or enter(name, args))
    short, long = torch.randn(3, 4, 8), torch.randn(3, 6, 8)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", tpcompile.TPCompileWarning)
        tpcompile.simulate_ranks(2, lambda r: ranks[r](long))  # the capture for length 6, made before the profile
        others = [d.graphs()[0] for d in dispatch]
        done = [install(gm) for gm in ranks]
        filled = [d.graph_forward is not None for d in dispatch] + ["forward" in g.__dict__ for g in others]
        outs = [tpcompile.simulate_ranks(2, lambda r: ranks[r](x)) for x in (short, long)]
        for d in done:
            d.undo()
        expected = [model(x) for x in (short, long)]
    assert all(filled) and all(d.skipped == 0 for d in done)
    assert all(gm.__dict__["forward"] is d and d.graph_forward is None for gm, d in zip(ranks, dispatch))
    assert all("forward" not in g.__dict__ for g in others) and sm.shapes.reshards == 1
    assert all(max_diff(o, e) < 1e-5 for o, e in zip(outs, expected))
    calls = Counter(n.split(" (")[0] for n in regions if n.startswith(COLLECTIVE))  # 2 ranks x 2 lengths each
    assert calls == {COLLECTIVE + "grad_all_reduce @ up": 4, COLLECTIVE + "all_reduce @ down": 4}
