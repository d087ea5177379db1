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


def test_a_read_the_rewrite_cannot_convert_is_an_error_not_the_value_as_it_is() -> None:
    """An op that wants an input laid out in a way the rewrite has no conversion for (a column split's output, split
    along its features, read as split along the tokens) raises, naming the value and both layouts: handed on
    unconverted, the op would compute on one rank's features as if they were its tokens."""
    from torch import nn

    from tpcompile.passes.rewrite import _Emitter, _rewrite_node
    from tpcompile.placement import Shard
    from tpcompile.sharding_rules.rule_context import Want

    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    sm = tpcompile.shard(model, 2, example_inputs=(torch.randn(2, 6, 16),))
    em = _Emitter(sm.captured, sm.decisions, 0)
    for node in sm.captured.graph.nodes:
        _rewrite_node(em, node)
        if sm.decisions.placement(node) == Shard(2):  # the first linear's output: its features split
            break
    assert em.converted(Want(node, Shard(2))) is em.env[node]  # read as it is laid out: itself
    with pytest.raises(ValueError, match=rf"{node.name} is laid out S\(2\) here and read as S\(1\)seq, a conversion"):
        em.converted(Want(node, Shard(1, seq=True)))
