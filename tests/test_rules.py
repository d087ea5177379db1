"""Sharding rules one behaviour at a time, on tiny modules, each with its numerical twin."""
from __future__ import annotations

import warnings

import pytest
import sympy
import torch
import torch.nn.functional as F
from torch import nn

import tpcompile
from tpcompile.placement import Shard
from tpcompile.sharding_rules.shape import reshape_placement


def _check(model: nn.Module, x: torch.Tensor, ws: int = 2) -> tpcompile.ShardedModel:
    """Shard, then assert every rank equals the original on a new batch."""
    sm = tpcompile.shard(model, ws, example_inputs=(x,))
    x2 = torch.randn(x.shape[0] + 3, *x.shape[1:])
    with torch.no_grad():
        ref = model(x2)
        for out in tpcompile.simulate(sm, x2):
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    return sm


def test_reshape_splits_a_sharded_dim_into_whole_heads() -> None:
    """(B, T, 512) sharded on 512 -> (B, T, 8, 64): whole heads, dim 2."""
    b, t = sympy.Symbol("b"), sympy.Symbol("t")
    out, why = reshape_placement(Shard(2), (b, t, 512), (b, t, 8, 64), 2)
    assert out == Shard(2) and why == ""


def test_reshape_merges_heads_back() -> None:
    """(B, T, 8, 64) sharded on heads -> (B, T, 512): plain shard of the merged dim."""
    b, t = sympy.Symbol("b"), sympy.Symbol("t")
    assert reshape_placement(Shard(2), (b, t, 8, 64), (b, t, 512), 4)[0] == Shard(2)


def test_reshape_of_segmented_dim_finds_the_head_dim() -> None:
    """q|k|v segments (3 x 512) -> (B, T, 3, 8, 64): the heads dim is sharded."""
    b, t = sympy.Symbol("b"), sympy.Symbol("t")
    out, _ = reshape_placement(Shard(2, (512, 512, 512)), (b, t, 1536), (b, t, 3, 8, 64), 2)
    assert out == Shard(3)


def test_reshape_refuses_heads_the_world_size_does_not_divide() -> None:
    """6 heads at 4 ranks cannot be split; the reason names the sizes."""
    out, why = reshape_placement(Shard(1), (5, 48), (5, 6, 8), 4)
    assert out is None and "6 is not divisible by world size 4" in why


def test_reshape_through_flattened_tokens() -> None:
    """(B, T, C) sharded on C -> (B*T, C) -> keeps the shard on the last dim."""
    b, t = sympy.Symbol("b"), sympy.Symbol("t")
    assert reshape_placement(Shard(2), (b, t, 64), (b * t, 64), 2)[0] == Shard(1)


class SwiGLU(nn.Module):
    """gate and up column splits multiplied, down a row split."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(32, 96, bias=False), nn.Linear(32, 96, bias=False), nn.Linear(96, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


def test_swiglu_is_two_columns_and_a_row() -> None:
    """Gated MLP: gate and up column-split, down row-split, one all-reduce."""
    sm = _check(SwiGLU(), torch.randn(4, 32))
    assert sm.plan.modules == {"gate": "column", "up": "column", "down": "row"}
    assert [op for op, _ in sm.collectives()] == ["all_reduce"]


class FusedGateUp(nn.Module):
    """One projection chunked into gate and up (Phi-3 style)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up, self.down = nn.Linear(32, 128), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


def test_fused_gate_up_is_sliced_per_segment() -> None:
    """A fused gate|up projection is split per segment so the chunk stays aligned."""
    sm = _check(FusedGateUp(), torch.randn(4, 32))
    assert sm.plan.parameters["gate_up.weight"].segments == (64, 64)


class InterleavedGateUp(nn.Module):
    """One projection whose gate and up features alternate (gpt-oss): `gu[..., ::2]` and `gu[..., 1::2]`."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up, self.down = nn.Linear(32, 128), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up(x)
        return self.down(F.silu(gu[..., ::2]) * gu[..., 1::2])


@pytest.mark.parametrize("ws", [2, 4])
def test_interleaved_gate_up_is_split_by_whole_strides(ws: int) -> None:
    """Each rank's block holds whole strides: its strided entries are its share of the gate and of the up
    features, contiguous for the row split after; no warning, exact with gradients."""
    torch.manual_seed(0)
    model = InterleavedGateUp().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpcompile.TPCompileWarning)
        sm = _check(model, torch.randn(4, 32), ws)
    assert sm.plan.modules == {"gate_up": "column", "down": "row"}
    report = tpcompile.check_gradients(model.train(), sm, torch.randn(3, 32))
    assert report.ok, str(report)


class NormOverHidden(nn.Module):
    """A column split, a norm over the split dim, and two projections reading the normalised value."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.norm = nn.Linear(16, 32), nn.LayerNorm(32)
        self.a, self.b = nn.Linear(32, 16), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.fc(x))
        return self.a(h) * self.b(h)


def test_norm_over_split_dim_replicates_with_a_named_warning() -> None:
    """A LayerNorm over the column split's output, read by two projections, keeps fc whole and says why."""
    with pytest.warns(tpcompile.TPCompileWarning, match=r"aten.layer_norm.default .* over the split dim 1: its result "
                                                        r"reaches 2 weight ops.*; replicating fc"):
        sm = _check(NormOverHidden(), torch.randn(4, 16))
    assert sm.plan.modules["fc"] == "replicated" and "fc" in sm.plan.replicated


class UnknownOp(nn.Module):
    """An op with no row in the table applied along a split dim, which DTensor's strategy cannot keep split either."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.cummax(self.fc(x), dim=1).values)


def test_op_without_rule_is_replicated_and_named() -> None:
    """aten.cummax along the split dim has no rule and no DTensor strategy: its region is replicated, the warning
    names the op."""
    with pytest.warns(tpcompile.TPCompileWarning, match=r"aten.cummax.default .*no sharding rule"):
        sm = _check(UnknownOp(), torch.randn(4, 16))
    assert sm.plan.modules["fc"] == "replicated"


class SoftmaxOverHeads(nn.Module):
    """Softmax over the split features, read by two projections."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out, self.gate = nn.Linear(16, 32), nn.Linear(32, 16), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = torch.softmax(self.fc(x), dim=-1)
        return self.out(p) + self.gate(p)


def test_softmax_over_split_dim_replicates() -> None:
    """Softmax along the split dim whose result feeds two row splits: the projection before it stays whole."""
    with pytest.warns(tpcompile.TPCompileWarning, match="softmax over the split dim 1"):
        sm = _check(SoftmaxOverHeads(), torch.randn(4, 16))
    assert sm.plan.modules["fc"] == "replicated"


class EinsumAttention(nn.Module):
    """Attention written with einsum on (B, T, heads, dim) tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(64, 64) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (f(x).view(b, t, 4, 16) for f in (self.q, self.k, self.v))
        att = torch.einsum("bthd,bshd->bhts", q, k).softmax(-1)
        return self.o(torch.einsum("bhts,bshd->bthd", att, v).reshape(b, t, c))


def test_einsum_attention_keeps_whole_heads() -> None:
    """Heads flow through einsum: q/k/v column, o row, one all-reduce."""
    sm = _check(EinsumAttention(), torch.randn(2, 8, 64))
    assert sm.plan.modules == {"q": "column", "k": "column", "v": "column", "o": "row"}
    assert [op for op, _ in sm.collectives()] == ["all_reduce"]


class StackedQKV(nn.Module):
    """qkv projection reshaped to (B, T, 3, heads, dim), permuted and unbound (timm / ViT style)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(64, 192), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, 4, 16).permute(2, 0, 3, 1, 4).unbind(0)
        return self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, c))


def test_stacked_qkv_is_sliced_per_segment() -> None:
    """The (3, heads, dim) reshape makes q|k|v segments, so heads are split, not q from k."""
    sm = _check(StackedQKV(), torch.randn(2, 8, 64))
    assert sm.plan.parameters["qkv.weight"].segments == (64, 64, 64)
    assert sm.plan.modules == {"qkv": "column", "o": "row"}


# --- the op table's schema: rule files are validated row by row, errors name the key and line ---

from pathlib import Path  # noqa: E402

from tpcompile.sharding_rules.registry import RULES  # noqa: E402
from tpcompile.sharding_rules.table import load_table  # noqa: E402


def test_every_registered_rule_is_used_and_every_row_names_one() -> None:
    """The op table names only registered rules, and every registered rule has at least one op."""
    used = {spec.rule for spec in load_table().values()}
    assert used == set(RULES)
    assert all(callable(r.fn) and (not r.listed or not r.args) for r in RULES.values())


def test_bundled_table_passes_its_schema() -> None:
    """ops.yaml loads: linear is a weight matmul with its argument positions, add is pointwise."""
    table = load_table()
    assert table["aten.linear.default"].rule == "weight_matmul"
    assert table["aten.linear.default"].args == {"input": 0, "weight": 1, "bias": 2, "weight_layout": "out_in"}
    assert table["aten.add.Tensor"].rule == "pointwise"


@pytest.mark.parametrize("text, message", [
    ("aten.linear.default: {rule: weight_matmull}\n", r"line 1: aten\.linear\.default: unknown rule 'weight_matmull'; use one of"),
    ("aten.add.Tensor: {rule: pointwise}\naten.view.default: {rule: reshape, shape_ar: 1}\n",
     r"line 2: aten\.view\.default: unknown field 'shape_ar' for rule reshape; its fields: shape_arg, sizes_arg, dim_arg"),
    ("aten.view.default: {rule: reshape, shape_arg: one}\n", r"line 1: aten\.view\.default: shape_arg: 'one' is not an argument position"),
    ("aten.view.default: {rule: reshape, shape_arg: -1}\n", r"shape_arg: '-1' is not an argument position"),
    ("aten.mm.default: {rule: weight_matmul, weight_layout: rows}\n", r"weight_layout: 'rows'; use one of out_in, in_out"),
    ("aten.mm.default: {input: 0}\n", r"line 1: aten\.mm\.default has no 'rule' field"),
    ("pointwise:\n  - aten.add.Tensor\n  - add\n", r"line 3: 'add' is not an op name of the form namespace\.op\.overload"),
    ("pointwise:\n  - aten.add.Tensor\naten.add.Tensor: {rule: matmul}\n", r"line 3: aten\.add\.Tensor already has a row at line 2"),
    ("pointwise: aten.add.Tensor\n", r"line 1: pointwise must be a list of op names"),
    ("aten.mm.default: matmul\n", r"line 1: aten\.mm\.default: the row must be a mapping"),
    ("aten.mm.default: {rule: matmul\n", r"YAML syntax error at line 2, column 1"),
    ("- aten.mm.default\n", r"the top level must be a mapping"),
])
def test_rule_file_errors_name_key_and_line(tmp_path: Path, text: str, message: str) -> None:
    """A malformed rule file is rejected before use, naming the file, line and offending key."""
    path = tmp_path / "ops.yaml"
    path.write_text(text)
    with pytest.raises(tpcompile.TPCompileError, match=rf"rule file {path}.*{message}"):
        load_table(str(path))


# --- regressions found by the fuzzer (tests/test_fuzz.py) ---

class FewHeads(nn.Module):
    """Attention with 2 query heads of 4 and an output projection: fewer query heads than 4 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(8, 8, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, 2, 4).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = ((q @ k.transpose(-2, -1)) * 0.5).softmax(dim=-1) @ v  # written out: matmuls take shared pieces
        return self.o(y.transpose(1, 2).reshape(B, T, 8))


def test_row_split_of_heads_shared_by_ranks_puts_them_one_to_a_rank() -> None:
    """2 query heads at 4 ranks: no row split of pieces two ranks share (it summed each head twice and crashed
    on shapes); the heads go one to a rank, zero-padded (1|1|0|0), without a warning, and stay exact."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpcompile.TPCompileWarning)
        sm = _check(FewHeads(), torch.randn(2, 5, 8), ws=4)
    assert sm.plan.modules["q"] == sm.plan.modules["k"] == sm.plan.modules["v"] == "column"
    assert sm.plan.modules["o"] == "row"
    assert [p.local_shape for p in sm.plan.parameters.values() if p.name == "q.weight"] == [(4, 8)]


class FewHeadsNoProjection(FewHeads):
    """The same attention returning the heads merged, with no output projection after them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, 2, 4).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = ((q @ k.transpose(-2, -1)) * 0.5).softmax(dim=-1) @ v
        return y.transpose(1, 2).reshape(B, T, 8)


def test_output_of_heads_shared_by_ranks_is_not_gathered() -> None:
    """2 heads at 4 ranks reaching the output: gathering the pieces gave (B, T, 16), each head
    twice; now the heads go one to a rank, zero-padded, and the output is exact."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpcompile.TPCompileWarning)
        sm = _check(FewHeadsNoProjection(), torch.randn(2, 5, 8), ws=4)
    assert sm.plan.modules["q"] == "column"


class CatWithEmpty(nn.Module):
    """A cache-like `torch.cat([torch.tensor([]), x], dim=1)`: cat skips the empty 1-D tensor (XLM's past states)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.cat([torch.tensor([]), F.gelu(self.up(x))], dim=0)
        return self.down(h)


def test_cat_with_an_empty_1d_tensor_keeps_the_split() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpcompile.TPCompileWarning)
        sm = _check(CatWithEmpty().eval(), torch.randn(4, 32))
    assert sm.plan.modules == {"up": "column", "down": "row"}

