"""The frozen plan: propagation's decision is one immutable value that the rewrite reads, not the captured graph."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import tpcompile
from tpcompile.api import shard_captured
from tpcompile.capture import capture
from tpcompile.passes.decisions import KEYS

from test_uneven_heads import Net, _exact


def _model() -> Net:
    torch.manual_seed(0)
    return Net(6, 3).eval()  # 6 heads on 3 kv heads: split evenly at 3 ranks, padded by whole heads at 4


def test_the_captured_graph_carries_no_decision() -> None:
    """After shard() the propagation's node.meta keys are gone from the graph and its region bodies; the decision
    is the ShardedModel's `decisions`, which places the weight ops and cuts the parameters."""
    sm = tpcompile.shard(_model(), 4, example_inputs=(torch.randn(2, 8, 40),))
    graphs = [m for m in sm.captured.modules() if isinstance(m, torch.fx.GraphModule)]
    assert [k for g in graphs for n in g.graph.nodes for k in KEYS if k in n.meta] == []
    q = next(n for n in sm.captured.graph.nodes if n.op == "get_attr" and n.target == "blocks.0.attn.q.weight")
    assert sm.decisions.layout(next(iter(q.users))) is not None
    assert sm.decisions.slice_for("blocks.0.attn.q.weight") == sm.slice_for("blocks.0.attn.q.weight")
    assert sm.decisions.slice_for("blocks.0.attn.q.weight").padded == 64  # 6 heads of 8 padded to 8 heads
    with pytest.raises(dataclasses.FrozenInstanceError):
        sm.decisions.world_size = 2
    with pytest.raises(TypeError):
        sm.decisions.cuts["blocks.0.attn.q.weight"] = None


def test_a_second_decision_on_the_same_graph_leaves_the_first_intact() -> None:
    """Two world sizes decided on one captured graph, one after the other (as the planner prices degrees): each
    ShardedModel builds its ranks from its own frozen plan, so the first is still exact after the second."""
    model = _model()
    cap = capture(model, (torch.randn(2, 8, 40),), None, None)
    first = shard_captured(cap, 4)
    second = shard_captured(cap, 3)
    assert first.plan.parameters["blocks.0.attn.q.weight"].local_shape == (16, 40)  # 2 of 8 padded heads
    assert second.plan.parameters["blocks.0.attn.q.weight"].local_shape == (16, 40)  # 2 of 6 heads
    assert first.decisions.slice_for("blocks.0.attn.q.weight").padded == 64
    assert second.decisions.slice_for("blocks.0.attn.q.weight").padded is None
    _exact(model, first, torch.randn(3, 11, 40))
    _exact(model, second, torch.randn(3, 11, 40))
