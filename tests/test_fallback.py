"""Ops with no row in ops.yaml keep a split through PyTorch DTensor's op strategies, each checked numerically.

Every case puts one op between a column split (16 -> 32) and a row split (32 -> 16); the op acts
on a dim the split is not on, or on the split dim as a batch. The op has no row in the table, so
its placement comes from DTensor's strategy; the rank graphs must equal the original on another
batch and length at world sizes 2 and 4, with both projections split and no warning.
"""
from __future__ import annotations

import copy
import warnings
from dataclasses import replace
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpcompile
from tpcompile.api import shard_captured
from tpcompile.capture import capture
from tpcompile.placement import Shard
from tpcompile.sharding_rules.table import op_name

Op = Callable[[torch.Tensor], torch.Tensor]


def _channels_first(f: Op) -> Op:
    """(B, T, C) -> f on (B, C, T) -> (B, T, C): the split features become conv/pool channels."""
    return lambda h: f(h.transpose(1, 2)).transpose(1, 2)


def _features_first(f: Op) -> Op:
    """(B, T, C) -> f on (C, 1, B, T) -> back: the split features become the batch of a 2-D op."""
    return lambda h: f(h.permute(2, 0, 1).unsqueeze(1)).squeeze(1).permute(1, 2, 0)


def _heads_first(f: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Op:
    """(B, T, 32) -> 4 heads first, (4, B*T, 8): f(heads, per-head bias) -> back."""
    def run(h: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        B, T, _ = h.shape
        a = h.view(B, T, 4, 8).permute(2, 0, 1, 3).reshape(4, B * T, 8)
        return f(a, bias).reshape(4, B, T, 8).permute(1, 2, 0, 3).reshape(B, T, 32)
    return run  # type: ignore[return-value]


# (name, the function of the split hidden value, the aten op that must carry the split without a row)
CASES: list[tuple[str, Op, str]] = [
    ("celu", F.celu, "aten.celu.default"),
    ("flip", lambda h: torch.flip(h, [1]), "aten.flip.default"),
    ("roll", lambda h: torch.roll(h, 1, 1), "aten.roll.default"),
    ("index_select", lambda h: torch.index_select(h, 1, torch.tensor([1, 0])).mean(1, keepdim=True) + h,
     "aten.index_select.default"),
    ("kthvalue", lambda h: torch.kthvalue(h, 2, 1, keepdim=True)[0] + h, "aten.kthvalue.default"),
    ("sort", lambda h: torch.sort(h, 1)[0], "aten.sort.default"),
    ("topk", lambda h: torch.topk(h, 2, 1)[0].sum(1, keepdim=True) + h, "aten.topk.default"),
    ("glu", lambda h: F.glu(torch.cat([h, h.sin()], 1), 1), "aten.glu.default"),
    ("diff", lambda h: torch.diff(h, dim=1, prepend=h[:, :1]), "aten.diff.default"),
    ("cumprod", lambda h: torch.cumprod(h.sigmoid(), 1), "aten.cumprod.default"),
    ("cummax", lambda h: torch.cummax(h, 1)[0], "aten.cummax.default"),
    ("logcumsumexp", lambda h: torch.logcumsumexp(h, 1), "aten.logcumsumexp.default"),
    ("prod", lambda h: torch.prod(h.sigmoid(), 1, keepdim=True) * h, "aten.prod.dim_int"),
    ("nan_to_num", lambda h: torch.nan_to_num(h / h.abs().sign()), "aten.nan_to_num.default"),
    ("logsigmoid", F.logsigmoid, "aten.log_sigmoid.default"),
    ("softshrink", lambda h: F.softshrink(h, 0.1), "aten.softshrink.default"),
    ("hardshrink", lambda h: F.hardshrink(h, 0.1), "aten.hardshrink.default"),
    ("logaddexp", lambda h: torch.logaddexp(h, h.cos()), "aten.logaddexp.default"),
    ("hypot", lambda h: torch.hypot(h, h.cos()), "aten.hypot.default"),
    ("xlogy", lambda h: torch.xlogy(h, h.sigmoid()), "aten.xlogy.Tensor"),
    ("copysign", lambda h: torch.copysign(h, h.cos()), "aten.copysign.Tensor"),
    ("atan2", lambda h: torch.atan2(h, h.cos() + 2), "aten.atan2.default"),
    ("lerp", lambda h: torch.lerp(h, h.sin(), 0.3), "aten.lerp.Scalar"),
    ("addcmul", lambda h: torch.addcmul(h, h, h.cos(), value=0.5), "aten.addcmul.default"),
    ("xlogy", lambda h: torch.xlogy(h, h.sigmoid()), "aten.xlogy.Tensor"),
    ("clamp_min_", lambda h: (h * 1).clamp_min_(0.1), "aten.clamp_min_.default"),
    ("avg_pool1d", _channels_first(lambda c: F.avg_pool1d(c, 3, 1, 1)), "aten.avg_pool1d.default"),
]


class Between(nn.Module):
    """A column split, `fn` on its split output, a row split."""

    def __init__(self, fn: Op) -> None:
        super().__init__()
        self.up, self.down, self.fn = nn.Linear(16, 32), nn.Linear(32, 16), fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.fn(self.up(x)))


class HeadsFirst(nn.Module):
    """Four heads laid out first, a per-head bias added by baddbmm (ALiBi-like), then a row split."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)
        self.bias = nn.Parameter(torch.randn(4, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def scores(a: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
            return torch.baddbmm(bias, a, a.transpose(1, 2)).softmax(-1) @ a
        return self.down(_heads_first(scores)(self.up(x), self.bias))  # type: ignore[call-arg]


def _check(model: nn.Module, op: str, *, row: bool = False) -> None:
    """Capture once; at world sizes 2 and 4 the op carries the split without a row (or with a row whose rule gives
    up, `row`) and every rank equals the original."""
    example, other = torch.randn(2, 5, 16), torch.randn(3, 7, 16)
    cap = capture(model.eval(), (example,))
    for ws in (2, 4):
        with warnings.catch_warnings():
            warnings.simplefilter("error", tpcompile.TPCompileWarning)
            warnings.simplefilter("ignore", FutureWarning)  # deepcopy of torch's pytree spec
            sm = shard_captured(replace(cap, gm=copy.deepcopy(cap.gm)), ws)
        nodes = [n for n in sm.captured.graph.nodes if n.op == "call_function" and op_name(n.target) == op]
        decided = sm.decisions
        assert nodes and all((decided.rule(n) is not None) == row for n in nodes), f"{op}: not in the graph, or row"
        assert any(isinstance(decided.placement(n), (Shard, tuple)) for n in nodes), f"{op} was not split"
        assert sm.plan.modules == {"up": "column", "down": "row"}
        with torch.no_grad():
            ref = model(other)
            for out in tpcompile.simulate(sm, other):
                torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name, fn, op", CASES, ids=[c[0] for c in CASES])
def test_op_keeps_the_split_through_dtensor(name: str, fn: Op, op: str) -> None:
    """The op between a column and a row split keeps both split, through DTensor's strategy; ranks equal the original."""
    _check(Between(fn), op)


def test_convolution_with_a_computed_weight_keeps_the_split_through_dtensor() -> None:
    """conv2d has a row, but with a computed weight on a split input its rule gives up; DTensor's strategy keeps
    the split (the split features are the convolution's batch); ranks equal the original."""
    conv = _features_first(lambda c: F.conv2d(c, torch.full((1, 1, 3, 3), 0.1), padding=1))
    _check(Between(conv), "aten.conv2d.default", row=True)


def test_baddbmm_with_a_per_head_bias_keeps_heads_split() -> None:
    """baddbmm on heads laid out first, its per-head bias sliced locally: both projections split, exact."""
    _check(HeadsFirst(), "aten.baddbmm.default")


def test_wrong_dtensor_answer_is_refused() -> None:
    """DTensor's logsumexp strategy ignores a positional keepdim; the numeric check refuses that answer."""
    from tpcompile.sharding_rules.fallback_check import agrees
    gm = torch.fx.symbolic_trace(lambda x: torch.ops.aten.logsumexp.default(x, [0], True))
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    x.meta["val"] = torch.empty(4, 4, 8)
    assert not agrees(node, [x], [(4, 4, 8)], [Shard(2)], Shard(1), {}, 2)  # DTensor's answer
    assert agrees(node, [x], [(4, 4, 8)], [Shard(2)], Shard(2), {}, 2)  # the right one
