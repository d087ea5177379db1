"""How tests/test_padded_ops.py and tests/test_more_ranks_than_heads.py check a model of tests/padded_models.py or
tests/group_models.py: sharded with the warnings kept, its outputs against the original's in the simulator and on a
gloo group."""
from __future__ import annotations

import warnings

import torch

import tpcompile


def shard(model: torch.nn.Module, ws: int) -> tuple[tpcompile.ShardedModel, list[str]]:
    """`model` sharded at `ws` ranks on a (2, 5, 32) example, and the warnings shard gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, ws, example_inputs=(torch.randn(2, 5, 32),))
    return sm, [str(w.message) for w in caught if issubclass(w.category, tpcompile.TPCompileWarning)]


def equal(model: torch.nn.Module, sm: tpcompile.ShardedModel) -> None:
    """Every rank's output on another batch and length equals the original's (the suite's tolerances)."""
    x = torch.randn(3, 7, 32)
    with torch.no_grad():
        ref = model(x)
        for out in tpcompile.simulate(sm, x):
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


def split(model: torch.nn.Module, ws: int, column: tuple[str, ...] = (), row: tuple[str, ...] = (),
           one_all_reduce: bool = False) -> tpcompile.ShardedModel:
    """`model` sharded at `ws` ranks without a warning, the `column` and `row` weights split so, (one all-reduce a
    forward), its outputs equal the original's."""
    sm, warned = shard(model, ws)
    assert warned == []
    roles = {n: p.role for n, p in sm.plan.parameters.items()}
    assert all(roles[n] == "column" for n in column) and all(roles[n] == "row" for n in row), roles
    if one_all_reduce:
        assert sorted(op for op, _ in sm.collectives()) == ["all_reduce"]
    equal(model, sm)
    return sm


def parallel_diffs(classes: tuple) -> dict:
    """Per model class: tpcompile.parallelize on this process's group (the startup agreement compares the ranks'
    schedules), the largest difference of its output from the original's on another batch and length."""
    out = {}
    for cls in classes:
        torch.manual_seed(0)
        model = cls()
        gm = tpcompile.parallelize(model, example_inputs=(torch.randn(2, 5, 32),))
        x = torch.randn(3, 7, 32, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            out[cls.__name__] = float((gm(x) - model(x)).abs().max())
    return out
