"""2-D and 3-D convolutions split by channels like linear layers: a whole input makes a column split (output
channels), a channel-split input a row split (input channels, one all-reduce), grouped ones split by whole
groups. Small CNNs split; a ViT's patch embedding, which starts the residual stream, stays whole and its blocks
split as Megatron's. Every rank equals the original on another batch and image size, forward and backward."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpcompile


class Block(nn.Module):
    """A pre-norm transformer block: fused qkv attention by heads, then an MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, N, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, D))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class ViT(nn.Module):
    """Patch embedding (Conv2d, kernel = stride = patch), flattened into tokens, a class token and learned
    positions (sliced to the token count), `depth` transformer blocks, a linear head on the class token."""

    def __init__(self, d: int = 32, patch: int = 4, max_tokens: int = 32, depth: int = 1) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, d, patch, stride=patch)
        self.cls = nn.Parameter(torch.randn(1, 1, d))
        self.pos = nn.Parameter(torch.randn(1, max_tokens, d) * 0.1)
        self.blocks = nn.Sequential(*(Block(d, 4) for _ in range(depth)))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, 10)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        t = self.patch(img).flatten(2).transpose(1, 2)  # (B, D, h, w) -> (B, h*w, D)
        t = torch.cat([self.cls.expand(t.shape[0], -1, -1), t], 1)
        t = self.blocks(t + self.pos[:, : t.shape[1]])
        return self.head(self.ln(t)[:, 0])


class CNN(nn.Module):
    """conv 3 -> 16, depthwise 3x3 (16 groups), pointwise 16 -> 32, grouped 32 -> 32 (4 groups), each with ReLU,
    then average pooling and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 16, 3, padding=1)
        self.dw = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.pw = nn.Conv2d(16, 32, 1)
        self.grouped = nn.Conv2d(32, 32, 3, padding=1, groups=4)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.pw(F.relu(self.dw(F.relu(self.c1(x))))))
        h = F.relu(self.grouped(h))
        return self.head(F.adaptive_avg_pool2d(h, 1).flatten(1))


class GroupedStem(nn.Module):
    """A grouped convolution on the whole input (4 groups of 1 channel -> 4), then a row convolution, pooling."""

    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Conv2d(4, 16, 3, padding=1, groups=4)
        self.c = nn.Conv2d(16, 8, 3, padding=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(F.gelu(self.g(x))).mean((2, 3))


class Video(nn.Module):
    """Conv3d 3 -> 8 (column), GELU, conv3d 8 -> 8 (row), pooled, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv3d(3, 8, 3, padding=1)
        self.c2 = nn.Conv3d(8, 8, (1, 3, 3), padding=(0, 1, 1))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.c2(F.gelu(self.c1(x))).mean((2, 3, 4)))


class UpSample(nn.Module):
    """Conv2d 3 -> 8 (column), ReLU, ConvTranspose2d 8 -> 4, stride 2 (row: its weight (in, out, k, k) cut on
    dim 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(8, 4, 4, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(F.relu(self.down(x)))


def _shard(model: nn.Module, ws: int, *inputs: torch.Tensor) -> tpcompile.ShardedModel:
    """shard() with no warning but the one naming an input dim the model's code fixes (the image channels)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, ws, example_inputs=inputs)
    said = [str(w.message) for w in caught if issubclass(w.category, tpcompile.TPCompileWarning)]
    assert not [w for w in said if "is fixed at" not in w], said
    return sm


def _share(sm: tpcompile.ShardedModel, names: list[str]) -> float:
    """The largest rank's share of the named parameters' elements (every rank holds local_shape)."""
    plan = sm.plan.parameters
    return sum(math.prod(plan[n].local_shape) for n in names) / sum(math.prod(plan[n].global_shape) for n in names)


def _conv_params(model: nn.Module) -> list[str]:
    convs = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose2d)
    return [f"{m}.{p}" for m, mod in model.named_modules() if isinstance(mod, convs) for p, _ in
            mod.named_parameters(recurse=False)]


def _equal(sm: tpcompile.ShardedModel, model: nn.Module, x: torch.Tensor) -> None:
    """Every rank's output equals the original's, and every parameter gradient its slice of the original's."""
    with torch.no_grad():
        ref = model(x)
        for r, out in enumerate(tpcompile.simulate(sm, x)):
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5, msg=lambda m: f"rank {r}: {m}")
    report = tpcompile.check_gradients(model, sm, x)
    assert report.ok, str(report)


@pytest.mark.parametrize("ws,depth", [(2, 1), (4, 1), (2, 2)])
def test_vit_patch_embedding_is_whole_and_the_blocks_split_as_megatron(ws: int, depth: int) -> None:
    """The patch embedding starts the residual stream, so it is whole by design (a note, no warning) and each
    block splits as Megatron's: qkv and fc1 by columns, proj and fc2 by rows, one all-reduce for attention and
    one for the MLP, then the head's column output gathered; <= 1.25/ws of the blocks' parameters on the largest
    rank; equal at another batch and image size, forward and backward."""
    torch.manual_seed(0)
    model = ViT(depth=depth).eval()
    sm = _shard(model, ws, torch.randn(2, 3, 16, 16))
    roles = {f"blocks.{i}.{m}": r for i in range(depth) for m, r in
             (("qkv", "column"), ("proj", "row"), ("fc1", "column"), ("fc2", "row"))}
    assert {m: sm.plan.modules[m] for m in ["patch", *roles]} == {"patch": "replicated", **roles}
    assert sm.plan.replicated["patch"].startswith("embedding convolution: whole on every rank"), sm.plan.replicated
    assert sm.plan.parameters["patch.weight"].local_shape == (32, 3, 4, 4)
    reduces = [("all_reduce", f"blocks.{i}.{m}") for i in range(depth) for m in ("proj", "fc2")]
    assert sm.collectives() == reduces + [("all_gather_replicated", "")]
    assert _share(sm, [n for n in sm.plan.parameters if n.startswith("blocks.")]) <= 1.25 / ws
    _equal(sm, model, torch.randn(3, 3, 12, 20))


class AudioStem(nn.Module):
    """Whisper's encoder stem: conv1d 8 -> 32 and conv1d 32 -> 32 (stride 2), each with GELU, frames into
    tokens, learned positions, one transformer block, a final norm."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv1d(8, d, 3, padding=1), nn.Conv1d(d, d, 3, stride=2, padding=1)
        self.pos = nn.Parameter(torch.randn(8, d) * 0.1)
        self.block, self.ln = Block(d, 4), nn.LayerNorm(d)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        t = F.gelu(self.c2(F.gelu(self.c1(mel)))).transpose(1, 2)
        return self.ln(self.block(t + self.pos[: t.shape[1]]))


@pytest.mark.parametrize("ws", [2, 4])
def test_convolution_pair_before_a_residual_stream_still_splits(ws: int) -> None:
    """Two convolutions before the stream (Whisper's stem) stay a column / row pair, the second's sum reduced
    once into the stream, whose block splits as Megatron's: three all-reduces; equal at another length, forward
    and backward."""
    torch.manual_seed(0)
    model = AudioStem().eval()
    sm = _shard(model, ws, torch.randn(2, 8, 16))
    assert {m: sm.plan.modules[m] for m in ("c1", "c2", "block.qkv", "block.proj", "block.fc1", "block.fc2")} == \
        {"c1": "column", "c2": "row", "block.qkv": "column", "block.proj": "row", "block.fc1": "column",
         "block.fc2": "row"}
    assert sm.collectives() == [("all_reduce", "c2"), ("all_reduce", "block.proj"), ("all_reduce", "block.fc2")]
    _equal(sm, model, torch.randn(3, 8, 12))


@pytest.mark.parametrize("ws", [2, 4])
def test_cnn_splits_every_convolution(ws: int) -> None:
    """conv1 column, the depthwise one on its ranks' channels, the pointwise one a row split (one all-reduce
    between them), the grouped one a column split by whole groups: <= 1.25/ws of the convolutions' parameters on
    the largest rank; equal at another batch and image size, forward and backward."""
    torch.manual_seed(0)
    model = CNN().eval()
    sm = _shard(model, ws, torch.randn(2, 3, 8, 8))
    assert {m: sm.plan.modules[m] for m in ("c1", "dw", "pw", "grouped")} == \
        {"c1": "column", "dw": "channels", "pw": "row", "grouped": "column"}
    assert sm.plan.parameters["dw.weight"].local_shape == (16 // ws, 1, 3, 3)
    assert sm.plan.parameters["pw.weight"].local_shape == (32, 16 // ws, 1, 1)
    assert sm.plan.parameters["grouped.weight"].local_shape == (32 // ws, 8, 3, 3)
    assert _share(sm, _conv_params(model)) <= 1.25 / ws
    assert [op for op, _ in sm.collectives()].count("all_reduce") == 2  # pw's sum, the head's row split
    _equal(sm, model, torch.randn(3, 3, 10, 6))


@pytest.mark.parametrize("ws", [2, 4])
def test_grouped_convolution_on_a_whole_input_is_a_column_split(ws: int) -> None:
    """A grouped convolution fed the whole input convolves its ranks' groups (the input's channels a local
    slice, the group count local), and the next convolution is a row split whose sum stays pending to the end."""
    torch.manual_seed(0)
    model = GroupedStem().eval()
    sm = _shard(model, ws, torch.randn(2, 4, 6, 6))
    assert sm.plan.modules == {"g": "column", "c": "row"}
    assert sm.plan.parameters["g.weight"].local_shape == (16 // ws, 1, 3, 3)
    assert [op for op, _ in sm.collectives()] == ["all_reduce"]
    _equal(sm, model, torch.randn(3, 4, 5, 7))


@pytest.mark.parametrize("ws", [2, 4])
def test_conv3d_pair_is_column_then_row(ws: int) -> None:
    """Two 3-D convolutions: column then row, one all-reduce; equal on another clip size, forward and backward."""
    torch.manual_seed(0)
    model = Video().eval()
    sm = _shard(model, ws, torch.randn(2, 3, 4, 6, 6))
    assert {m: sm.plan.modules[m] for m in ("c1", "c2")} == {"c1": "column", "c2": "row"}
    assert sm.plan.parameters["c2.weight"].local_shape == (8, 8 // ws, 1, 3, 3)
    assert _share(sm, _conv_params(model)) <= 1.25 / ws
    _equal(sm, model, torch.randn(3, 3, 5, 7, 5))


def test_transposed_convolution_row_split_cuts_its_input_channels() -> None:
    """ConvTranspose2d after a column convolution: a row split, its weight (in, out, k, k) cut on dim 0 and the
    bias added once after the all-reduce; equal at another image size, forward and backward."""
    torch.manual_seed(0)
    model = UpSample().eval()
    sm = _shard(model, 2, torch.randn(2, 3, 8, 8))
    assert sm.plan.modules == {"down": "column", "up": "row"}
    assert sm.plan.parameters["up.weight"].local_shape == (4, 4, 4, 4)
    assert sm.plan.parameters["up.bias"].local_shape == (4,)
    _equal(sm, model, torch.randn(3, 3, 10, 6))


def test_output_channels_the_ranks_do_not_divide_are_zero_padded() -> None:
    """6 output channels at 4 ranks: padded to 8, two a rank (the last rank's are zeros), the next convolution a
    row split over them; no warning, one all-reduce, exact forward and gradients at another image size."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3), nn.ReLU(), nn.Conv2d(6, 8, 3)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, 4, example_inputs=(torch.randn(2, 3, 8, 8),))
    first, second = sm.plan.parameters["0.weight"], sm.plan.parameters["2.weight"]
    assert (first.role, first.padded, first.local_shape) == ("column", 8, (2, 3, 3, 3))
    assert (second.role, second.padded, second.local_shape) == ("row", 8, (8, 2, 3, 3))
    assert sm.plan.parameters["0.bias"].local_shape == (2,)
    assert [op for op, _ in sm.collectives()] == ["all_reduce"]
    _equal(sm, model, torch.randn(1, 3, 9, 7))
    report = tpcompile.check_gradients(model.train(), sm, torch.randn(2, 3, 8, 9))
    assert report.ok, str(report)


class RawConvolution(nn.Module):
    """`torch.convolution` spelled out (aten.convolution): a plain 2-D one, then a transposed one."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.b1 = nn.Parameter(torch.randn(8, 3, 3, 3) * 0.3), nn.Parameter(torch.randn(8))
        self.w2, self.b2 = nn.Parameter(torch.randn(8, 3, 2, 2) * 0.3), nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(torch.convolution(x, self.w1, self.b1, [1, 1], [1, 1], [1, 1], False, [0, 0], 1))
        return torch.convolution(h, self.w2, self.b2, [2, 2], [0, 0], [1, 1], True, [0, 0], 1)


@pytest.mark.parametrize("ws", [2, 4])
def test_aten_convolution_reads_its_transposed_flag(ws: int) -> None:
    """aten.convolution: the plain one a column split (weight dim 0), the transposed one a row split of its
    (in, out, k, k) weight on dim 0; equal at another image size, forward and backward."""
    torch.manual_seed(0)
    model = RawConvolution().eval()
    sm = _shard(model, ws, torch.randn(2, 3, 6, 6))
    assert sm.plan.parameters["w1"].local_shape == (8 // ws, 3, 3, 3)
    assert sm.plan.parameters["w2"].local_shape == (8 // ws, 3, 2, 2)
    assert sm.plan.parameters["b2"].role == "replicated"
    _equal(sm, model, torch.randn(3, 3, 5, 7))
