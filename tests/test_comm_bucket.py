"""Gradient bucketing: per-parameter syncs reduced once per bucket, in backward order, sums unchanged."""
from __future__ import annotations

import warnings
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn

import tpcompile
from tpcompile.models.gpt import GPT, GPTConfig
from tpcompile.ops import collectives
from tpcompile.passes.comm_bucket import META_KEY

BUCKET = torch.ops.tpcompile.grad_bucket_all_reduce.default
PER_PARAM = (torch.ops.tpcompile.grad_all_reduce.default, torch.ops.tpcompile.grad_piece_all_reduce.default)


def _gpt(n_layer: int) -> GPT:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return GPT(GPTConfig(n_layer=n_layer)).train()


def _shard(model: nn.Module, ws: int, comm: Any, **kw: Any) -> tpcompile.ShardedModel:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tpcompile.TPCompileWarning)
        example = kw.pop("example_inputs") if "example_inputs" in kw else model.example_inputs()
        return tpcompile.shard(model, ws, example_inputs=example, comm=comm, **kw)


def _step(sm: tpcompile.ShardedModel, *args: Any, **kwargs: Any) -> tuple[list, Counter]:
    """Per rank: output and every gradient after one backward; the backward collectives of rank 0."""
    def one(rank: int) -> tuple:
        gm = sm.rank(rank)
        gm.zero_grad(set_to_none=True)
        out = gm(*args, **kwargs)
        out = out if isinstance(out, torch.Tensor) else out["logits"]
        out.float().pow(2).mean().backward()
        return out.detach(), {n: p.grad.clone() for n, p in gm.named_parameters() if p.grad is not None}
    with collectives.record() as events:
        res = tpcompile.simulate_ranks(sm.world_size, one)
    return res, Counter(e.op for e in events if e.rank == 0 and e.phase == "backward")


def _same(got: list, want: list, tol: float = 0.0) -> None:
    for (out, grads), (rout, rgrads) in zip(got, want):
        assert torch.allclose(out, rout, atol=tol, rtol=0)
        assert grads.keys() == rgrads.keys()
        for k in grads:
            assert torch.allclose(grads[k], rgrads[k], atol=tol, rtol=0), k


@pytest.mark.parametrize("n_layer", [1, 3])
def test_sequence_parallel_gradient_syncs_do_not_grow_with_blocks(n_layer: int) -> None:
    """Under sequence parallelism the norm and row-bias gradient syncs are one bucket: 1 backward
    all-reduce at 1 and at 3 blocks (per parameter it was 6 per block + 2); gradients unchanged."""
    model = _gpt(n_layer)
    ids = model.example_inputs()[0]
    plain, bucketed = _shard(model, 2, False, sequence_parallel=True), _shard(model, 2, True, sequence_parallel=True)
    want, plain_counts = _step(plain, ids)
    got, counts = _step(bucketed, ids)
    _same(got, want)
    assert plain_counts["all_reduce"] == 6 * n_layer + 2
    assert counts["all_reduce"] == 1
    # the activations' backward collectives are untouched: one all-gather and reduce-scatter pair per region
    assert counts - Counter({"all_reduce": counts["all_reduce"]}) == \
        plain_counts - Counter({"all_reduce": plain_counts["all_reduce"]})
    gm = bucketed.rank(0)
    assert not any(n.target in PER_PARAM for n in gm.graph.nodes)
    (node,) = [n for n in gm.graph.nodes if n.target is BUCKET]
    index, nbytes, names = node.meta[META_KEY]
    assert index == 0 and len(names) == 6 * n_layer + 2 and "transformer.ln_f.weight" in names
    assert nbytes == 4 * sum(dict(gm.named_parameters())[n].numel() for n in names)


def test_bucket_size_splits_in_backward_order() -> None:
    """A 1 KB cap: several buckets, the first (index 0) holding the last-used parameters; same numerics."""
    model = _gpt(2)
    ids = model.example_inputs()[0]
    small = _shard(model, 2, tpcompile.CommOptions(bucket_bytes=1024), sequence_parallel=True)
    buckets = [n for n in small.rank(0).graph.nodes if n.target is BUCKET]
    assert len(buckets) > 2
    indices = [n.meta[META_KEY][0] for n in buckets]
    assert indices == sorted(indices, reverse=True)  # graph order is the reverse of backward order
    assert buckets[-1].meta[META_KEY][2][-1] == "transformer.ln_f.bias"
    for n in buckets:  # each at most the cap, unless a single parameter is larger
        assert n.meta[META_KEY][1] <= 1024 or len(n.meta[META_KEY][2]) == 1
    got, counts = _step(small, ids)
    want, _ = _step(_shard(model, 2, False, sequence_parallel=True), ids)
    _same(got, want)
    assert counts["all_reduce"] == len(buckets)


def test_bucketing_off_keeps_per_parameter_syncs() -> None:
    """bucket_bytes=0 leaves the per-parameter grad_all_reduce nodes as rewrite emitted them."""
    sm = _shard(_gpt(1), 2, tpcompile.CommOptions(bucket_bytes=0), sequence_parallel=True)
    nodes = sm.rank(0).graph.nodes
    assert not any(n.target is BUCKET for n in nodes)
    assert sum(n.target is PER_PARAM[0] for n in sm.rank(0).graph.nodes) == 8


def test_shared_kv_head_pieces_are_bucketed() -> None:
    """Llama with 2 kv heads at 4 ranks: the k/v piece gradients join one bucket; gradients unchanged."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      max_position_embeddings=64)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    kw = {"example_kwargs": {"input_ids": ids, "use_cache": False}, "example_inputs": ()}
    plain = _shard(model, 4, False, **dict(kw))
    bucketed = _shard(model, 4, True, **dict(kw))
    assert plain.plan.parameters["model.layers.0.self_attn.k_proj.weight"].pieces == 2
    want, plain_counts = _step(plain, input_ids=ids, use_cache=False)
    got, counts = _step(bucketed, input_ids=ids, use_cache=False)
    _same(got, want, tol=1e-6)
    # per block: 2 activation all-reduces stay; the k and v piece syncs (2 per block) become 1 bucket
    assert plain_counts["all_reduce"] == 2 * 2 + 1 + 2 * 2
    assert counts["all_reduce"] == 2 * 2 + 1 + 1
    (node,) = [n for n in bucketed.rank(0).graph.nodes if n.target is BUCKET]
    assert sorted(node.args[2]) == [2, 2, 2, 2]


class FusedMultiQuery(nn.Module):
    """Blocks of causal attention with one fused q|k|v projection and a single kv head (multi-query): at 2
    ranks each block's k and v segments are pieces of one split of the fused weight."""

    def __init__(self, d: int = 32, heads: int = 4, blocks: int = 2) -> None:
        super().__init__()
        self.heads, self.hd = heads, d // heads
        self.qkv = nn.ModuleList(nn.Linear(d, d + 2 * self.hd) for _ in range(blocks))
        self.out = nn.ModuleList(nn.Linear(d, d) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        for qkv, out in zip(self.qkv, self.out):
            q, k, v = qkv(x).split([D, self.hd, self.hd], dim=-1)
            q = q.view(B, T, self.heads, self.hd).transpose(1, 2)
            k, v = (t.view(B, T, 1, self.hd).transpose(1, 2)[:, :, None].expand(B, 1, self.heads, T, self.hd)
                    .reshape(B, self.heads, T, self.hd) for t in (k, v))  # as Hugging Face's repeat_kv
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + out(y.transpose(1, 2).reshape(B, T, D))
        return x


def test_pieces_of_one_fused_weight_split_are_bucketed_in_order() -> None:
    """The k and v pieces of two blocks' fused weights join one bucket: the later block's split, which both of
    its pieces read, is moved up once, before both (the rank graph is well formed); gradients unchanged."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = FusedMultiQuery().train()
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(1))
    plain, bucketed = _shard(model, 2, False, example_inputs=(x,)), _shard(model, 2, True, example_inputs=(x,))
    assert plain.plan.parameters["qkv.1.weight"].seg_pieces == (2, 1, 1)  # q split, the kv head whole
    (node,) = [n for n in bucketed.rank(0).graph.nodes if n.target is BUCKET]
    assert len(node.args[0]) == 8  # the k and v segments of both blocks' weights and biases
    want, plain_counts = _step(plain, x)
    got, counts = _step(bucketed, x)
    _same(got, want, tol=1e-6)
    assert plain_counts["all_reduce"] == counts["all_reduce"] + 7


class OnePlusNorm(nn.Module):
    """RMS norms that scale by `1 + weight` (as Gemma's do) around column/row MLPs, in blocks."""

    def __init__(self, d: int = 32, blocks: int = 3) -> None:
        super().__init__()
        self.norms = nn.ParameterList(nn.Parameter(0.1 * torch.randn(d)) for _ in range(blocks))
        self.up = nn.ModuleList(nn.Linear(d, 4 * d) for _ in range(blocks))
        self.down = nn.ModuleList(nn.Linear(4 * d, d) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w, up, down in zip(self.norms, self.up, self.down):
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w.float())
            x = x + down(torch.nn.functional.gelu(up(h)))
        return x


def test_values_computed_from_parameters_alone_are_bucketed() -> None:
    """Under sequence parallelism the `1 + weight` of the norms that read split tokens (blocks 1 and 2; block 0
    reads the whole input) and the row biases join one bucket: the 5 per-parameter backward all-reduces
    become 1, the one of block 0's column input stays; gradients unchanged."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = OnePlusNorm().train()
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(1))
    plain, bucketed = (_shard(model, 2, comm, example_inputs=(x,), sequence_parallel=True) for comm in (False, True))
    want, plain_counts = _step(plain, x)
    got, counts = _step(bucketed, x)
    _same(got, want, tol=1e-6)
    assert plain_counts["all_reduce"] == 1 + 5 and counts["all_reduce"] == 1 + 1
    (node,) = [n for n in bucketed.rank(0).graph.nodes if n.target is BUCKET]
    names = node.meta[META_KEY][2]
    assert [n for n in names if n.startswith("norms")] == ["norms.1", "norms.2"]
    assert node.meta[META_KEY][1] == 4 * (2 * 32 + 3 * 32)  # two (1 + weight) and three row biases, float32
