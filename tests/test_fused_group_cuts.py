"""A fused q|k|v projection whose kv groups are cut among the ranks sharing each kv head (Phi-3's `qkv_proj`, sliced
into q, k and v): one cut of its output features, the q segment by groups (one piece a rank), the k and v segments
in kv pieces each held by the ranks that share it. Each rank holds ceil(group / sharing ranks) query heads and its
kv head, not a whole padded group."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpcompile
from tpcompile.report.plan_table import split_text

from sgd_steps import sgd_losses
from test_uneven_heads import _exact, _net, _shard

HEAD = 4


class FusedAttention(nn.Module):
    """Grouped-query attention with one q|k|v projection, sliced as Phi-3 slices it (or split, `split=True`)."""

    def __init__(self, width: int, heads: int, kv_heads: int, head_dim: int, split: bool = False) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.split = heads, kv_heads, head_dim, split
        self.qkv = nn.Linear(width, (heads + 2 * kv_heads) * head_dim, bias=False)
        self.o = nn.Linear(heads * head_dim, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(x)
        q_end, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        if self.split:
            q, k, v = qkv.split([q_end, kv, kv], dim=-1)
        else:
            q, k, v = qkv[..., :q_end], qkv[..., q_end:q_end + kv], qkv[..., q_end + kv:]
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        rep = self.heads // self.kv_heads
        k = k[:, :, None].expand(b, self.kv_heads, rep, t, self.head_dim).reshape(b, self.heads, t, self.head_dim)
        v = v[:, :, None].expand(b, self.kv_heads, rep, t, self.head_dim).reshape(b, self.heads, t, self.head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


def _fused_net(heads: int, kv: int, split: bool = False) -> nn.Module:
    model = _net(heads, kv, head_dim=HEAD, width=40)
    torch.manual_seed(1)
    for block in model.blocks:
        block.attn = FusedAttention(40, heads, kv, HEAD, split)
    return model.eval()


@pytest.mark.parametrize("heads, kv, ws, split", [(12, 4, 8, False), (12, 4, 8, True), (6, 2, 4, False),
                                                  (28, 4, 8, True)])
def test_a_fused_projection_cuts_its_groups(heads: int, kv: int, ws: int, split: bool) -> None:
    """Each rank holds ceil(group / sharing ranks) query heads of its kv group and that kv head's k and v (sliced
    or split into q, k and v), no warning, two all-reduces a block, exact forward on another batch and length,
    and gradients."""
    model = _fused_net(heads, kv, split)
    sm, warned = _shard(model, ws)
    assert not warned, [str(w.message) for w in warned]
    share, group = ws // kv, heads // kv
    per_rank = -(-group // share) * HEAD
    qkv = sm.plan.parameters["blocks.0.attn.qkv.weight"]
    assert (qkv.role, qkv.local_shape) == ("column", (per_rank + 2 * HEAD, 40))
    assert sm.plan.parameters["blocks.0.attn.o.weight"].local_shape == (40, per_rank)
    assert sorted(op for op, _ in sm.collectives()) == ["all_reduce"] * 4
    _exact(model, sm, torch.randn(3, 13, 40), torch.randn(2, 9, 40))


def test_the_plan_shows_each_ranks_part_of_the_fused_projection() -> None:
    """12 heads on 4 kv heads at 8 ranks: rank 2k holds 2 heads of group k, rank 2k + 1 one (and a zero head), each
    with kv head k's key and value (4 heads and 3 heads of 4 rows); every real row of the fused weight is on a rank,
    k and v rows on two."""
    sm, _ = _shard(_fused_net(12, 4), 8)
    qkv = sm.plan.parameters["blocks.0.attn.qkv.weight"]
    assert split_text(qkv) == "column@0 12|12|12|12|16|16 cut 16|12|16|12|16|12|16|12 heads 4|3|4|3|4|3|4|3"
    held = {}
    for r in range(8):
        for start, _, n in tpcompile.placement.rank_pieces(qkv.slice(), 80, r, 8):
            for i in range(start, start + n):
                held[i] = held.get(i, 0) + 1
    assert sorted(held) == list(range(80))
    assert {held[i] for i in range(48)} == {1} and {held[i] for i in range(48, 80)} == {2}


def test_training_steps_equal_one_process() -> None:
    """Three SGD steps on every rank equal three on the model: the k and v rows, shared by the two ranks of their kv
    head, get the sum of both ranks' gradients, and the zero heads' rows stay zero."""
    model = _fused_net(12, 4)
    sm, _ = _shard(model, 8)
    ranks = [sm.rank(r) for r in range(8)]
    xs = [torch.randn(2, 9, 40) for _ in range(3)]

    losses = tpcompile.simulate_ranks(8, lambda r: sgd_losses(ranks[r], xs, 0.1))
    ref_model = model.train()
    ref = sgd_losses(ref_model, xs, 0.1)
    for r in range(8):
        assert losses[r] == pytest.approx(ref, rel=1e-5), (r, losses[r], ref)
    merged = sm.merge_state_dicts([g.state_dict() for g in ranks])
    for name, t in ref_model.state_dict().items():
        torch.testing.assert_close(merged[name], t, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["phi3", "falcon", "gpt_bigcode"])
def test_hugging_face_fused_projections_at_eight_ranks(name: str) -> None:
    """A fused q|k|v with 12 heads on 4 kv heads (Phi-3: its groups cut, 1.25 x ideal with whole padded groups;
    Falcon: segments padded each; GPTBigCode: one kv head shared by every rank) at 8 ranks: equal to the model, no
    warning, and the largest rank within the uneven table's 1.15 x a split balanced by units (the reference reads
    each kind of cut: a group cut's q is one projection, padded or shared segments are apart)."""
    import hf_models
    from bench.arch_table import run_one
    from bench.uneven_table import BALANCED, COUNTS
    arch = next(a for a in hf_models.ALL_ARCHS if a.name == name)
    row = run_one(arch, 8, config=COUNTS)
    assert row["diff"] < 1e-4 and not row["warnings"], row
    assert row["balanced"] <= BALANCED, row
    if name == "phi3":
        assert row["share"] * 8 < 1.15, row


def test_phi3_generation_splits_the_cache_by_kv_heads() -> None:
    """Greedy generation of a Phi-3 (one qkv_proj) with 12 heads on 4 kv heads at 8 ranks: HF's tokens on every
    rank, and each rank holds one kv head of the cache (a quarter of it)."""
    import warnings

    from test_generate import padded_prompts, run_ranks
    from transformers import Phi3Config, Phi3ForCausalLM

    from tpcompile.generate import shard_generation

    torch.manual_seed(0)
    config = Phi3Config(vocab_size=128, num_hidden_layers=2, hidden_size=48, intermediate_size=64,
                        num_attention_heads=12, num_key_value_heads=4, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = Phi3ForCausalLM(config).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpcompile.TPCompileWarning)
        gen = shard_generation(model, 8, max_seq_len=48, max_batch_size=2)
    ids, mask = padded_prompts()
    want = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    for out in run_ranks(gen, input_ids=ids, attention_mask=mask, max_new_tokens=12):
        assert torch.equal(out, want)
    assert max(gen.cache_bytes(r) for r in range(8)) == gen.unsharded_cache_bytes // 4
