"""Zoo architectures at 3 ranks, where 4 heads, 2 kv heads and widths of 64 do not divide: split as at 2 and 4.

Bamba (Mamba-2 mixer): its heads zero-padded meet the one group of B and C shared by every rank, an einsum, an F.pad
along the tokens, the parts of a split and a gated RMSNorm over the padded heads' features. Falcon-H1: a buffer
(mup_vector) multiplies the mixer's fused projection, whose segments are zero-padded each.
"""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
pytest.importorskip("transformers")
from bench import zoo, zoo_uneven  # noqa: E402


@pytest.mark.parametrize("arch", ["bamba", "falcon_h1"])
def test_mamba_mixers_split_at_three_ranks(arch: str) -> None:
    """Equal to the original on another batch and length, nothing replicated with a warning, the mixer's
    projections split (held x ws as at 2 ranks or better than replicating: below 1.35), within 1.15 x a split
    balanced by the mixer's units (its Mamba heads, and B and C's one group)."""
    row = zoo.run_ws(arch, 3)
    assert row["equal"], row.get("reason")
    assert row["warnings"] == []
    assert row["share"] * 3 < 1.35
    assert row["balanced"] <= 1.15


@pytest.mark.parametrize("ws", [3, 5, 6, 8])
def test_docs_section_is_the_cache_rendered(ws: int) -> None:
    """docs/architectures.md's sections on the zoo at 3, 5, 6 and 8 ranks are what bench/zoo_uneven.py makes of its
    caches and the zoo's own rows, never typed."""
    meta, rows = zoo.load_cache(zoo_uneven.cache_path(ws))
    begin, end = zoo_uneven.markers(ws)
    text = zoo.DOCS.read_text(encoding="utf-8")
    assert begin in text and end in text, f"python -m bench.zoo_uneven --world-size {ws} --render writes it"
    section = begin + text.split(begin, 1)[1].split(end, 1)[0] + end
    names = [n for n in zoo.zoo_types() if n in rows]
    want = zoo_uneven.render({n: rows[n] for n in names}, zoo.load_cache(zoo.CACHE)[1], meta, ws)
    assert section + "\n" == want, f"stale: python -m bench.zoo_uneven --world-size {ws} --render"


def test_a_warning_of_a_kind_seen_at_two_ranks_is_not_new() -> None:
    """The bar counts only warnings of a kind shard did not give at 2 and 4 ranks (numbers and names blanked)."""
    base = {"ws": {"2": {"warnings": ["aten.mean.dim (mean_1) at m.layers.0.attn: reduces over dim 2"]}}}
    row = {"ws": {"3": {"equal": True, "balanced": 1.0, "warnings": [
        "aten.mean.dim (mean_4) at m.layers.1.attn: reduces over dim 2",
        "aten.view.default (view) at m.layers.0.attn: reshape of a dim padded from 64 to 66 cuts through"]}}}
    assert zoo_uneven.new_warnings(row["ws"]["3"]["warnings"], base) == [row["ws"]["3"]["warnings"][1]]
    assert zoo_uneven.verdict(row, base) == (False, row["ws"]["3"]["warnings"][1])
    row["ws"]["3"]["warnings"].pop()
    assert zoo_uneven.verdict(row, base) == (True, "")
    row["ws"]["3"]["balanced"] = 1.2
    assert zoo_uneven.verdict(row, base)[0] is False


def test_a_kind_blanks_layouts_and_how_many_names() -> None:
    """A split's layout and the length of a list of names are values like numbers: S(2) and S(2~66), two names and
    three, are one kind."""
    two = "aten.linear.default (linear_3) at m: input slice_3 is S(2) but the op needs R; x is whole only because " \
        "m.h.0.a, m.h.0.b are replicated"
    three = "aten.linear.default (linear_9) at m: input slice_7 is S(2~66) but the op needs R; x is whole only " \
        "because m.h.0.a, m.h.1.a, m.h.1.b are replicated"
    assert zoo_uneven.new_warnings([three], {"ws": {"2": {"warnings": [two]}}}) == []
    assert zoo_uneven.new_warnings([three.replace("needs R", "needs S(1)")], {"ws": {"2": {"warnings": [two]}}})


def test_a_kind_leaves_out_the_cause_it_names() -> None:
    """A warning that follows from an upstream replication names it as its cause; which one is named follows the
    order the ops were judged in, and the cause is a warning of its own, so the kind leaves it out. The op and the
    reason stay in the kind."""
    at_two = "aten.matmul.default (matmul_3) at m.layers.1.idx: sharded along the contracted dim; its input is " \
        "whole only because m.layers.0.idx.wk is replicated (the root cause: aten.matmul.default (matmul_1) at " \
        "m.layers.0.idx: sharded along the contracted dim); replicating m.layers.1.idx.wq (results stay exact)"
    at_five = "aten.matmul.default (matmul_3) at m.layers.1.idx: sharded along the contracted dim; its input is " \
        "whole only because m.layers.0.idx.wk, m.layers.0.idx.wq are replicated (the root cause: " \
        "aten.split_with_sizes.default (split_4) at m.layers.0.idx: split into [8, 8] cuts through the per-rank " \
        "blocks [16] of dim 3 (S(3~20))); replicating m.layers.1.idx.wq (results stay exact)"
    base = {"ws": {"2": {"warnings": [at_two]}}}
    assert zoo_uneven.warning_kind(at_five) == zoo_uneven.warning_kind(at_two)
    assert zoo_uneven.new_warnings([at_five], base) == []
    other = at_five.replace("sharded along the contracted dim", "operands sharded differently")
    assert zoo_uneven.new_warnings([other], base) == [other]
    assert zoo_uneven.new_warnings([at_five.replace("matmul.default", "bmm.default")], base)


class _Heads(torch.nn.Module):
    """Attention with 4 heads of 16 whose sizes only the module itself knows (`head_dim`)."""

    head_dim = 16

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (torch.nn.Linear(64, 64) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, 4, 16).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, 64))


class _SubConfigs(torch.nn.Module):
    """A model whose config holds no head counts (they are in per-part sub-configs, as BLT's)."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace()
        self.self_attn = _Heads()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.self_attn(x)


def test_balanced_measure_takes_the_head_size_from_the_attention_module() -> None:
    """4 heads at 3 ranks put 2 heads (32 rows) on the largest rank, as a split balanced by heads does: the measure
    finds the head size on the module when the config has none, instead of counting 22 rows of single features."""
    import tpcompile
    from hf_models import balanced_bytes, param_bytes

    model = _SubConfigs()
    sm = tpcompile.shard(model, 3, example_inputs=(torch.randn(2, 5, 64),))
    assert sm.plan.parameters["self_attn.q_proj.weight"].local_shape == (32, 64)
    assert balanced_bytes(model, sm) == param_bytes(model, sm)[0]


def test_balanced_measure_counts_an_interleaved_qkv_by_whole_heads() -> None:
    """GPT-NeoX's query_key_value holds q, k and v interleaved per head; at 8 ranks its 4 heads go one to 2 ranks, 48
    rows each. A split balanced by heads can do no better (a rank computing a head needs its q, k and v): the
    measure's unit there is one head's q, k and v, not one of them (which counted 32 rows a rank and called the
    split 1.16 x balanced)."""
    import tpcompile
    from hf_models import balanced_bytes, param_bytes

    model = zoo.zoo_build("gpt_neox")
    sm = tpcompile.shard(model, 8, example_kwargs=zoo.zoo_inputs(model, *zoo.EXAMPLE, seed=1))
    assert sm.plan.parameters["gpt_neox.layers.0.attention.query_key_value.weight"].local_shape == (48, 64)
    assert balanced_bytes(model, sm) == param_bytes(model, sm)[0]


class _WideHeads(torch.nn.Module):
    """A config of 8 heads of 8 and an attention of 4 heads of 16 (a hybrid's linear attention, Bailing's): the
    module's own `num_heads` says how wide its heads are."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(head_dim=8, num_attention_heads=8, hidden_size=64)
        self.self_attn = _Heads()
        self.self_attn.num_heads = 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.self_attn(x)


def test_balanced_measure_counts_the_heads_of_the_module_not_of_the_config() -> None:
    """4 heads of 16 at 8 ranks put one head (16 rows) on the largest rank, as a split balanced by heads does: the
    measure's unit is the module's head, not the config's 8 features (which called the split 2 x balanced)."""
    import tpcompile
    from hf_models import balanced_bytes, param_bytes

    model = _WideHeads()
    sm = tpcompile.shard(model, 8, example_inputs=(torch.randn(2, 5, 64),))
    assert sm.plan.parameters["self_attn.q_proj.weight"].local_shape == (16, 64)
    assert balanced_bytes(model, sm) == param_bytes(model, sm)[0]


class _PerHeadNorm(torch.nn.Module):
    """A norm over each of 4 heads of 16, the only module of its block that says it has heads."""

    num_heads = 4

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = x.view(b, t, 4, 16)
        return (h / h.norm(dim=-1, keepdim=True)).reshape(b, t, 64) * self.weight


class _HeadedCell(torch.nn.Module):
    """A recurrent cell of 4 heads not named attention (xLSTM's mLSTM layer): gates per head, a per-head norm."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(hidden_size=64)
        self.q, self.v, self.out = (torch.nn.Linear(64, 64) for _ in range(3))
        self.norm = _PerHeadNorm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, v = (p(x).view(b, t, 4, 16) for p in (self.q, self.v))
        mixed = (torch.sigmoid(q) * v).cumsum(1).reshape(b, t, 64)
        return x + self.out(self.norm(mixed))


def test_balanced_measure_counts_heads_a_block_names_only_in_its_norm() -> None:
    """4 heads at 8 ranks put one head (16 rows) on the largest rank: the measure reads the heads off the block's
    per-head norm (its `num_heads`), instead of counting single features (which called the split 2 x balanced)."""
    import tpcompile
    from hf_models import balanced_bytes, param_bytes

    model = _HeadedCell()
    sm = tpcompile.shard(model, 8, example_inputs=(torch.randn(2, 5, 64),))
    assert sm.plan.parameters["q.weight"].local_shape == (16, 64)
    assert balanced_bytes(model, sm) == param_bytes(model, sm)[0]


class _NormedSplit(torch.nn.Module):
    """A projection normalised over its 16 features, then split into two runs of 8 (the sparse-attention indexer's
    key, rope | rest, DeepSeek-V3.2's): no head or segment is found behind the norm, so no split holds whole runs."""

    def __init__(self) -> None:
        super().__init__()
        self.wk, self.norm, self.o = torch.nn.Linear(32, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.norm(self.wk(x)).split([8, 8], dim=-1)
        return self.o(torch.cat([b, a], dim=-1))


def test_a_split_refused_at_two_ranks_is_refused_alike_at_three() -> None:
    """The split is refused at 2 and 4 ranks and, zero-padded, at 3: one reason, in the same words (the pieces and
    the blocks they cut through), so the zoo at 3 ranks counts no new kind of warning for it."""
    import warnings as w

    import tpcompile
    from bench.zoo_render import failure_class

    kinds = {}
    for ws in (2, 3, 4):
        torch.manual_seed(0)
        with w.catch_warnings(record=True) as got:
            w.simplefilter("always", tpcompile.TPCompileWarning)
            tpcompile.shard(_NormedSplit(), ws, example_inputs=(torch.randn(2, 5, 32),))
        said = [str(m.message) for m in got if issubclass(m.category, tpcompile.TPCompileWarning)]
        assert len(said) == 1 and "split into [8, 8] cuts through the per-rank blocks [16] of dim 2" in said[0], said
        kinds[ws] = failure_class(said[0])
    assert kinds[3] == kinds[2] == kinds[4]
