"""Higher-order regions: autocast and grad-mode regions, torch.cond and torch.map placed through their bodies."""
from __future__ import annotations

import math
import operator
import warnings
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._higher_order_ops import map as hop_map
from padded_models import Recurrent

import tpcompile
from tpcompile.passes.rank_module import local_tensor

hop = torch.ops.higher_order


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryBlock(nn.Module):
    """A Llama-style block: RMSNorm, q/k/v with the rotary embedding applied to q and k under
    autocast(cpu, enabled=False) in float32, causal SDPA, output projection, gated MLP."""

    def __init__(self, dim: int = 32, heads: int = 4, hidden: int = 64) -> None:
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.n1, self.n2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        inv = 1.0 / (10000 ** (torch.arange(0, self.hd, 2, dtype=torch.float32) / self.hd))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.n1(x)
        q, k, v = (p(h).view(b, t, self.heads, self.hd).transpose(1, 2) for p in (self.q, self.k, self.v))
        with torch.autocast("cpu", enabled=False):  # the rotary embedding kept in float32
            pos = torch.arange(t, device=x.device, dtype=torch.float32)
            freqs = torch.outer(pos, self.inv_freq.float())
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos()[None, None], emb.sin()[None, None]
            q = q.float() * cos + rotate_half(q.float()) * sin
            k = k.float() * cos + rotate_half(k.float()) * sin
        a = F.scaled_dot_product_attention(q.to(v.dtype), k.to(v.dtype), v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, c))
        g = self.n2(x)
        return x + self.down(F.silu(self.gate(g)) * self.up(g))


class GradRegions(nn.Module):
    """An MLP whose hidden features are scaled by a statistic taken under no_grad and centred by one taken under
    set_grad_enabled(False): no gradient flows through either statistic."""

    def __init__(self, dim: int = 16, hidden: int = 64) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        with torch.no_grad():
            s = h.abs().amax(-1, keepdim=True) + 1.0
        h = h / s
        with torch.set_grad_enabled(False):
            m = h.mean(-1, keepdim=True)
        return self.down(F.gelu(h - m))


class CondBlock(nn.Module):
    """An MLP whose split hidden activation goes through torch.cond: both branches elementwise, one of them
    scaled by a parameter the cond passes in."""

    def __init__(self, dim: int = 16, hidden: int = 64, branch: Callable | None = None) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(hidden))
        self.branch = branch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        true_fn = self.branch or (lambda a, s: F.gelu(a) * s)
        h = torch.cond(x.sum() > 0, true_fn, lambda a, s: torch.tanh(a) + s, (h, self.scale))
        return self.down(h)


class MapBlock(nn.Module):
    """An MLP whose split hidden activation goes through torch.map over the batch, the body elementwise with a
    parameter passed whole."""

    def __init__(self, dim: int = 16, hidden: int = 64, body: Callable | None = None) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(hidden))
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        h = hop_map(self.body or (lambda row, s: torch.relu(row) * s + row), h, self.scale)
        return self.down(h)


class AutocastScores(nn.Module):
    """Attention whose scores are computed under autocast(cpu, bfloat16) in a model captured without autocast:
    a region that changes the state, kept as a region with its body placed by heads."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k = self.q(x), self.k(x)
        v = self.v(x).view(b, t, self.heads, self.hd).transpose(1, 2)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the head count a literal inside: made local per rank
            q, k = (y.view(b, t, self.heads, self.hd).transpose(1, 2) for y in (q, k))
            w = torch.matmul(q, k.transpose(-1, -2)) * self.hd ** -0.5
        a = torch.softmax(w.float(), -1) @ v
        return self.o(a.transpose(1, 2).reshape(b, t, c))


def _shard(model: nn.Module, ws: int, x: torch.Tensor) -> tuple[tpcompile.ShardedModel, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, ws, example_inputs=(x,))
    return sm, [str(w.message) for w in caught if issubclass(w.category, tpcompile.TPCompileWarning)]


def _largest_share(model: nn.Module, sm: tpcompile.ShardedModel) -> float:
    """The share of the parameters (by elements) the largest rank holds."""
    local = sum(math.prod(pp.local_shape) for pp in sm.plan.parameters.values())
    return local / sum(p.numel() for p in model.parameters())


def _grads(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict, torch.Tensor]:
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out = module(x)
    out.float().pow(2).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in module.named_parameters()}, x.grad


def _check_equal(model: nn.Module, sm: tpcompile.ShardedModel, x: torch.Tensor, *, train: bool,
                 atol: float = 2e-5) -> None:
    """Every rank's output (and with train, its input and parameter gradients) equals the original's."""
    ref = model(x).detach()
    for r, out in enumerate(tpcompile.simulate(sm, x)):
        assert out.dtype == ref.dtype
        torch.testing.assert_close(out.detach(), ref, atol=atol, rtol=1e-4, msg=f"rank {r} output")
    if not train:
        return
    _, ref_grads, ref_xgrad = _grads(model, x)
    ranks = [sm.rank(r) for r in range(sm.world_size)]
    for r, (out, grads, xgrad) in enumerate(tpcompile.simulate_ranks(sm.world_size, lambda r: _grads(ranks[r], x))):
        torch.testing.assert_close(xgrad, ref_xgrad, atol=atol, rtol=1e-4, msg=f"rank {r} input grad")
        for n, g in grads.items():
            want = local_tensor(ref_grads[n], sm.plan.parameters[n].slice(), r, sm.world_size)
            torch.testing.assert_close(g, want, atol=atol, rtol=1e-4, msg=f"rank {r} grad of {n}")


def _targets(gm: torch.fx.GraphModule) -> set:
    return {n.target for n in gm.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("ws", [2, 4])
def test_rotary_under_autocast_disabled_splits_q_and_k_by_heads(ws: int) -> None:
    """The no-op autocast region is inlined: q, k, v, gate, up column, o and down row, no warning, the largest rank
    holds <= 1.25/ws of the parameters, and outputs and gradients equal the original at another batch and length."""
    torch.manual_seed(0)
    model = RotaryBlock()
    sm, warned = _shard(model, ws, torch.randn(2, 8, 32))
    assert not warned, warned
    assert hop.wrap_with_autocast not in _targets(sm.captured)
    assert sm.plan.modules == {"q": "column", "k": "column", "v": "column", "o": "row", "gate": "column",
                               "up": "column", "down": "row"}
    assert _largest_share(model, sm) <= 1.25 / ws
    _check_equal(model, sm, torch.randn(3, 6, 32), train=True)


@pytest.mark.parametrize("ws", [2, 4])
def test_rotary_region_under_an_autocast_capture_stays_a_region(ws: int) -> None:
    """Sharded inside autocast(cpu, bfloat16), autocast(enabled=False) changes the state: the rank graphs keep the
    region (disabled) with its body split by heads, every projection split, and outputs equal the original's
    under the same autocast within bfloat16 rounding."""
    torch.manual_seed(0)
    model = RotaryBlock()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sm, warned = _shard(model, ws, torch.randn(2, 8, 32))
        assert not warned, warned
        regions = [n for n in sm.rank(0).graph.nodes if n.target is hop.wrap_with_autocast]
        assert [n.args[2] for n in regions] == [False]
        assert sm.plan.modules == {"q": "column", "k": "column", "v": "column", "o": "row", "gate": "column",
                                   "up": "column", "down": "row"}
        x = torch.randn(3, 6, 32)
        ref = model(x).detach()
        for out in tpcompile.simulate(sm, x):
            torch.testing.assert_close(out.detach(), ref, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("ws", [2, 4])
def test_grad_mode_regions_are_inlined_without_gradient(ws: int) -> None:
    """no_grad and set_grad_enabled(False) regions are inlined on detached values: up column, down row, and outputs
    and gradients (none through the statistics) equal the original at another batch and length."""
    torch.manual_seed(0)
    model = GradRegions()
    sm, warned = _shard(model, ws, torch.randn(2, 5, 16))
    assert not warned, warned
    assert hop.wrap_with_set_grad_enabled not in _targets(sm.captured)
    assert sm.plan.modules == {"up": "column", "down": "row"}
    assert _largest_share(model, sm) <= 1.25 / ws
    _check_equal(model, sm, torch.randn(3, 7, 16), train=True)


@pytest.mark.parametrize("ws", [2, 3])
def test_a_block_applied_under_no_grad_and_with_grad_is_split_once(ws: int) -> None:
    """The same block applied under no_grad (its weights read detached) and with gradients: its weights are split
    once, column and row, for every application; no warning; outputs and gradients (the last application's only)
    equal the original's. Before, the detached reads were not weights, each weight was used both split and whole,
    and every projection was replicated."""
    torch.manual_seed(0)
    model = Recurrent()
    sm, warned = _shard(model, ws, torch.randn(2, 5, 32))
    assert not warned, warned
    assert sm.plan.modules == {"q": "column", "k": "column", "v": "column", "o": "row", "up": "column",
                               "down": "row"}
    _check_equal(model, sm, torch.randn(3, 7, 32), train=True)


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["true", "false"])
def test_cond_with_elementwise_branches_keeps_the_split(ws: int, sign: float) -> None:
    """Both branches place over the split hidden: up column, down row, the scale cut like the hidden; each branch's
    outputs and gradients equal the original's at another batch and length."""
    torch.manual_seed(0)
    model = CondBlock()
    sm, warned = _shard(model, ws, torch.randn(2, 5, 16).abs())
    assert not warned, warned
    assert sm.plan.modules == {"up": "column", "down": "row"}
    assert sm.plan.parameters["scale"].dim == 0
    assert _largest_share(model, sm) <= 1.25 / ws
    assert tpcompile.ops.regions.run_cond in _targets(sm.rank(0))
    _check_equal(model, sm, sign * torch.randn(3, 7, 16).abs(), train=True)


@pytest.mark.parametrize("ws", [2, 4])
def test_map_body_keeps_the_split(ws: int) -> None:
    """The map body places over the split hidden (one dim lower): up column, down row; outputs and gradients equal
    the original's at another batch and length."""
    torch.manual_seed(0)
    model = MapBlock()
    sm, warned = _shard(model, ws, torch.randn(2, 5, 16))
    assert not warned, warned
    assert sm.plan.modules == {"up": "column", "down": "row"}
    assert _largest_share(model, sm) <= 1.25 / ws
    assert tpcompile.ops.regions.run_map in _targets(sm.rank(0))
    _check_equal(model, sm, torch.randn(3, 7, 16), train=True)


@pytest.mark.parametrize("ws", [2, 4])
def test_autocast_region_that_changes_the_state_is_placed_through_its_body(ws: int) -> None:
    """A bfloat16 autocast region in a float32 capture stays a region, its body split by heads: q/k/v column,
    o row, outputs equal the original's (its bfloat16 scores included) at another batch and length."""
    torch.manual_seed(0)
    model = AutocastScores()
    sm, warned = _shard(model, ws, torch.randn(2, 8, 32))
    assert not warned, warned
    assert hop.wrap_with_autocast in _targets(sm.rank(0))
    assert sm.plan.modules == {"q": "column", "k": "column", "v": "column", "o": "row"}
    assert _largest_share(model, sm) <= 1.25 / ws
    _check_equal(model, sm, torch.randn(3, 6, 32), train=False, atol=1e-4)


@pytest.mark.parametrize("build, op", [
    (lambda: CondBlock(branch=lambda a, s: torch.softmax(a, -1) * s), "higher_order.cond.default"),
    (lambda: MapBlock(body=lambda row, s: torch.softmax(row, -1) * s), "higher_order.map_impl.default"),
], ids=["cond", "map"])
def test_body_needing_communication_falls_back_to_replicate(build: Callable[[], nn.Module], op: str) -> None:
    """A softmax over the split hidden inside a body would need a collective there: a TPCompileWarning names the
    region op, up is replicated, and the ranks still equal the original."""
    torch.manual_seed(0)
    model = build()
    sm, warned = _shard(model, 2, torch.randn(2, 5, 16).abs())
    assert any(op in w and "softmax" in w for w in warned), warned
    assert sm.plan.modules["up"] == "replicated"
    _check_equal(model, sm, torch.randn(3, 7, 16).abs(), train=False)


class NestedCond(nn.Module):
    """A cond whose predicate is a sum over the split hidden, its true branch holding an autocast(enabled=False)
    region and a no_grad one."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def true_fn(a: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", enabled=False):
                a = a.float() * 2
            with torch.no_grad():
                m = a.abs() + 1
            return F.gelu(a) / m

        h = self.up(x)
        return self.down(torch.cond(h.sum() > 0, true_fn, lambda a: -a, (h,)))


@pytest.mark.parametrize("ws", [2, 4])
def test_nested_regions_and_a_predicate_from_a_split_value(ws: int) -> None:
    """The regions inside a branch are inlined there, the predicate's pending sum is reduced before the cond, the
    split is kept, and both branches' outputs and gradients equal the original's."""
    torch.manual_seed(0)
    model = NestedCond()
    sm, warned = _shard(model, ws, torch.randn(2, 5, 16))
    assert not warned, warned
    assert sm.plan.modules == {"up": "column", "down": "row"}
    branch = _targets(sm.captured.true_graph_0)
    assert hop.wrap_with_autocast not in branch and hop.wrap_with_set_grad_enabled not in branch
    for want in (True, False):
        x = torch.randn(3, 7, 16)
        while bool(model.up(x).sum() > 0) != want:
            x = torch.randn(3, 7, 16)
        _check_equal(model, sm, x, train=True)


def test_region_body_is_its_own_per_rank() -> None:
    """Each rank's cond reads bodies of its own (rewritten for that rank), not the captured graph's."""
    torch.manual_seed(0)
    sm, _ = _shard(CondBlock(), 2, torch.randn(2, 5, 16).abs())
    captured = {id(m) for m in sm.captured.children()}
    for r in range(2):
        gm = sm.rank(r)
        bodies = [m for m in (operator.attrgetter(n.target)(gm) for n in gm.graph.nodes if n.op == "get_attr")
                  if isinstance(m, torch.fx.GraphModule)]
        assert len(bodies) == 2 and not captured & {id(b) for b in bodies}




class NoGradPassThrough(nn.Module):
    """A no_grad region (a sparse-attention indexer's, DeepSeek-V3.2's) that returns one of its inputs through a cast
    to the dtype it has: at run time the input itself, so its gradient flows on after the region, as it does
    through `.float()` of a float32 value and `.contiguous()` of a contiguous one; a real cast's result does not."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        with torch.no_grad():
            picked = h.argmax(-1, keepdim=True)
            same, contiguous, copied = h.float(), h.contiguous(), h.double()
        return self.down(same * 2 + contiguous) + picked + copied.float().sum(-1, keepdim=True)


@pytest.mark.parametrize("ws", [1, 2])
def test_a_no_grad_region_returning_its_input_through_a_no_op_cast_keeps_its_gradient(ws: int) -> None:
    """The region's outputs that are its input at run time (a cast to its own dtype, contiguous of a contiguous
    value) are that input after inlining, gradient included; the real cast stays detached: every gradient equals
    the original's (before, the input reached `down` detached and `up` got no gradient)."""
    torch.manual_seed(0)
    model = NoGradPassThrough()
    sm, warned = _shard(model, ws, torch.randn(2, 5, 16))
    assert not warned, warned
    assert hop.wrap_with_set_grad_enabled not in _targets(sm.captured)
    _check_equal(model, sm, torch.randn(3, 7, 16), train=True)
