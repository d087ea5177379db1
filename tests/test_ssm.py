"""A selective state-space block (Mamba's dataflow, written out) splits along its inner channels.

`in_proj` is a column split in two segments (x and the gate z, chunked after a transpose), the
depthwise convolution runs on each rank's channels with its group count made local, `x_proj` is
a row split whose one all-reduce feeds dt, B and C, `dt_proj` (applied as `W @ dt`) is a column
split, and `A_log`, `D` and the dt bias are cut like the channels they scale. Each block then
costs two all-reduces, and each rank holds about 1/world size of the weights.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from hf_models import held_share
from torch import nn

import tpcompile
from tpcompile.ops import collectives as C

D_MODEL, INNER, STATE, RANK, KERNEL, VOCAB, LAYERS = 32, 64, 8, 8, 3, 48, 2


class Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.in_proj = nn.Linear(D_MODEL, 2 * INNER, bias=False)
        self.conv = nn.Conv1d(INNER, INNER, KERNEL, groups=INNER, padding=KERNEL - 1)
        self.x_proj = nn.Linear(INNER, RANK + 2 * STATE, bias=False)
        self.dt_proj = nn.Linear(RANK, INNER)
        self.A_log = nn.Parameter(torch.randn(INNER, STATE) * 0.5)
        self.D = nn.Parameter(torch.rand(INNER))
        self.out_proj = nn.Linear(INNER, D_MODEL, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        xz = self.in_proj(h).transpose(1, 2)  # (B, 2I, T)
        x, z = xz.chunk(2, dim=1)
        x = F.silu(self.conv(x)[..., : xz.shape[-1]])
        dt, b, c = torch.split(self.x_proj(x.transpose(1, 2)), [RANK, STATE, STATE], dim=-1)
        dt = F.softplus(self.dt_proj.weight @ dt.transpose(1, 2) + self.dt_proj.bias[:, None])  # (B, I, T)
        a = -torch.exp(self.A_log)
        decay = torch.exp(a[None, :, None, :] * dt[..., None])  # (B, I, T, N)
        drive = dt[..., None] * b[:, None] * x[..., None]
        state = torch.zeros(h.shape[0], INNER, STATE)
        ys = []
        for t in range(h.shape[1]):  # the recurrence, one step per token
            state = decay[:, :, t] * state + drive[:, :, t]
            ys.append((state @ c[:, t, :, None])[..., 0])
        y = torch.stack(ys, dim=-1) + x * self.D[None, :, None]
        return self.out_proj((y * F.silu(z)).transpose(1, 2))


class SSM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.norms = nn.ModuleList(nn.LayerNorm(D_MODEL) for _ in range(LAYERS))
        self.mixers = nn.ModuleList(Mixer() for _ in range(LAYERS))
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for norm, mixer in zip(self.norms, self.mixers):
            h = h + mixer(norm(h))
        return self.head(h)


@pytest.mark.parametrize("ws", [2, 3, 4])
def test_state_space_block_splits_by_inner_channels(ws: int) -> None:
    """Equal at another batch, two all-reduces per block, every mixer weight cut, about 1/ws held; at 3 ranks the
    64 inner channels are zero-padded to 66, the depthwise convolution on 22 of them a rank."""
    torch.manual_seed(0)
    model = SSM().eval()
    with pytest.warns(tpcompile.TPCompileWarning, match="fixed at 6"):  # the loop over the tokens
        sm = tpcompile.shard(model, ws, example_inputs=(torch.randint(0, VOCAB, (2, 6)),))
    assert not sm.plan.warnings
    ids = torch.randint(0, VOCAB, (3, 6))
    with torch.no_grad(), C.record() as events:
        ref = model(ids)
        outs = tpcompile.simulate(sm, ids)
    for out in outs:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    forward = [e.op for e in events if e.rank == 0 and e.phase == "forward" and e.op in C.FORWARD_COLLECTIVES]
    assert forward.count("all_reduce") == 1 + 2 * LAYERS  # the embedding's, then x_proj's and out_proj's
    roles = {name: p.role for name, p in sm.plan.parameters.items()}
    for name, role in [("in_proj.weight", "column"), ("conv.weight", "channels"), ("conv.bias", "channels"),
                       ("x_proj.weight", "row"), ("dt_proj.weight", "column"), ("A_log", "follows"),
                       ("D", "follows"), ("out_proj.weight", "row")]:
        assert roles[f"mixers.0.{name}"] == role, (name, roles[f"mixers.0.{name}"])
    assert sm.plan.parameters["mixers.1.in_proj.weight"].segments == (INNER, INNER)
    assert held_share(model, sm) <= 1.1 / ws


def test_state_space_block_runs_at_another_length_after_one_shard() -> None:
    """The Python loop over the tokens is unrolled by the capture: another length is captured again, and equal."""
    torch.manual_seed(0)
    model = SSM().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, 2, example_inputs=(torch.randint(0, VOCAB, (2, 6)),))
    ids = torch.randint(0, VOCAB, (2, 7))
    with pytest.warns(tpcompile.TPCompileWarning, match="fixed that dim at 6.*re-sharded SSM"), torch.no_grad():
        outs = tpcompile.simulate(sm, ids)
        ref = model(ids)
    for out in outs:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


class Grouped(nn.Module):
    """A column split, then a grouped convolution (4 groups of 4 channels) and a row split."""

    def __init__(self, groups: int = 4) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.conv = nn.Conv1d(16, 16, 3, groups=groups, padding=1)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(self.up(x).transpose(1, 2)).transpose(1, 2)
        return self.down(F.gelu(y))


@pytest.mark.parametrize("ws", [2, 4])
def test_grouped_convolution_splits_by_whole_groups(ws: int) -> None:
    torch.manual_seed(0)
    model = Grouped().eval()
    sm = tpcompile.shard(model, ws, example_inputs=(torch.randn(2, 5, 8),))
    assert sm.plan.modules["conv"] == "channels" and sm.plan.parameters["conv.weight"].local_shape == (16 // ws, 4, 3)
    x = torch.randn(3, 7, 8)
    with torch.no_grad():
        for out in tpcompile.simulate(sm, x):
            torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


def test_grouped_convolution_with_fewer_groups_than_ranks_is_replicated_with_the_reason() -> None:
    model = Grouped(groups=2).eval()
    with pytest.warns(tpcompile.TPCompileWarning, match="2 groups over channels split across 4 ranks"):
        sm = tpcompile.shard(model, 4, example_inputs=(torch.randn(2, 5, 8),))
    x = torch.randn(3, 7, 8)
    with torch.no_grad():
        for out in tpcompile.simulate(sm, x):
            torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


class FusedGateUp(nn.Module):
    """A fused gate|up projection whose size along the tokens is read before it is chunked."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up = nn.Linear(8, 32, bias=False)
        self.down = nn.Linear(16, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up(x)
        g, u = gu.chunk(2, dim=-1)
        return self.down(F.silu(g) * u)[:, : gu.shape[1] - 1]


def test_a_size_read_of_a_whole_dim_needs_no_gather() -> None:
    """`gu.shape[1]` of a value split on its features in segments is read locally: the split stays."""
    torch.manual_seed(0)
    model = FusedGateUp().eval()
    sm = tpcompile.shard(model, 2, example_inputs=(torch.randn(2, 5, 8),))
    assert sm.plan.modules["gate_up"] == "column" and not sm.plan.warnings
    x = torch.randn(3, 9, 8)
    with torch.no_grad():
        for out in tpcompile.simulate(sm, x):
            torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


class SharedStateConv(nn.Module):
    """Mamba-2's pattern: x|B|C from one projection, one depthwise convolution over all of them (its weight read
    as `conv.weight.squeeze(1)`, then `unsqueeze(1)` inside F.conv1d), then split into x, B and C; B and C are
    one group of 4 channels, which a split by ranks would cut. The tokens are padded for the causal convolution
    with F.pad, or (`pad_by_cat`) by a cat of zeros, which hides the split from the search for segments."""

    def __init__(self, pad_by_cat: bool = True) -> None:
        super().__init__()
        self.in_proj = nn.Linear(16, 32 + 8)
        self.conv = nn.Conv1d(40, 40, 3, groups=40)
        self.out = nn.Linear(32, 16)
        self.pad_by_cat = pad_by_cat

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        xbc = self.in_proj(h).transpose(1, 2)
        w = self.conv.weight.squeeze(1)
        xbc = torch.cat([xbc.new_zeros(*xbc.shape[:2], 2), xbc], -1) if self.pad_by_cat else F.pad(xbc, (2, 0))
        xbc = F.conv1d(xbc, w.unsqueeze(1), self.conv.bias, groups=40).transpose(1, 2)
        x, b, c = torch.split(xbc, [32, 4, 4], dim=-1)
        return self.out(x * (b * c).sum(-1, keepdim=True))


def test_a_convolution_weight_read_through_views_is_read_whole_once_its_split_is_refused() -> None:
    """The split of x|B|C cuts B and C, so the projection and the convolution are replicated (a warning names the
    split); the weight, cut in an earlier round, is then read whole again rather than its views keeping the cut
    alive (which ended in 'cannot place these ops'); exact."""
    torch.manual_seed(0)
    model = SharedStateConv().eval()
    with pytest.warns(tpcompile.TPCompileWarning, match=r"split into \[32, 4, 4\]"):
        sm = tpcompile.shard(model, 2, example_inputs=(torch.randn(2, 6, 16),))
    assert sm.plan.parameters["conv.weight"].role == "replicated"
    x = torch.randn(3, 9, 16)
    with torch.no_grad():
        for out in tpcompile.simulate(sm, x):
            torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


def test_segments_found_through_the_padding_of_the_tokens() -> None:
    """With F.pad of the tokens before the convolution, x|B|C are found as segments of the projection (32 | 4 | 4,
    each split 2 ways), the convolution's channels cut alike; (b * c).sum over the split is a pending sum reduced
    with the output's: two all-reduces, exact, gradients equal."""
    torch.manual_seed(0)
    model = SharedStateConv(pad_by_cat=False).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, 2, example_inputs=(torch.randn(2, 6, 16),))
    assert sm.plan.parameters["in_proj.weight"].segments == (32, 4, 4)
    assert sm.plan.parameters["conv.weight"].local_shape == (20, 1, 3)
    assert [op for op, _ in sm.collectives()] == ["all_reduce", "all_reduce"]
    x = torch.randn(3, 9, 16)
    with torch.no_grad():
        for out in tpcompile.simulate(sm, x):
            torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)
    assert tpcompile.check_gradients(model, sm, torch.randn(2, 7, 16)).ok
