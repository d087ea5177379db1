"""Projections whose heads one attention pairs are cut into the same runs of heads (passes/head_runs.py).

DiffLlama's differential attention chunks its value heads into two halves and repeats each for every query head,
then combines head i with head i + h/2: each projection is two runs of heads, every rank holding its block of
each (zero-padded by whole heads where the ranks do not divide a half). Split at 2, 3, 4, 6 and 8 ranks with 4
and 8 heads: no warning, equal to the original on another batch and length, one all-reduce.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from padded_models import DiffAttention

import tpcompile


@pytest.mark.parametrize("heads,ws", [(4, 2), (4, 3), (4, 4), (8, 3), (8, 6), (8, 8)])
def test_halves_of_heads_split_at_any_world_size(heads: int, ws: int) -> None:
    torch.manual_seed(0)
    model = DiffAttention(heads)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, ws, example_inputs=(torch.randn(2, 5, 32),))
    plan = sm.plan.parameters
    for name in ("q.weight", "k.weight", "v.weight"):
        assert (plan[name].role, plan[name].segments) == ("column", (16, 16)), (name, plan[name])
        half = heads // 2  # each rank holds whole heads of each half, as many as a split balanced by heads
        assert plan[name].local_shape[0] == 2 * -(-half // ws) * (32 // heads), (name, plan[name].local_shape)
    assert plan["o.weight"].role == "row"
    assert [op for op, _ in sm.collectives()] == ["all_reduce"]
    x = torch.randn(3, 7, 32)
    with torch.no_grad():
        for out in tpcompile.simulate(sm, x):
            torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-4)

