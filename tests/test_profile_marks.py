"""The profiling pass: block and collective regions in a copy of each rank graph, the ranks' results unchanged."""
from __future__ import annotations

import functools
import linecache

import torch

import tpcompile
from tpcompile.models import GPT, GPTConfig
from tpcompile.ops.schedule import collective_op
from tpcompile.runtime.profiler_marks import (BLOCK, enter_collective, install, instrumented_graph, node_blocks,
                                              repeated_layers)

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
