"""Any input shape after one shard() call: a shape the rank graphs' guards refuse is captured and sharded again.

Three models whose code fixes a dim: an ALiBi bias built in Python from the sequence length, an
encoder whose padding-mask path loops over the batch, and transformers' FalconMamba (its scan without
kernels loops over the tokens). Each is sharded once and then equals the original at three other
lengths and batch sizes in the simulator; the ALiBi model does the same under 2 gloo processes
through `tpcompile.parallelize` (blocks checkpointed, a backward at each shape), each rank re-sharding
and agreeing on the new graph, as does a scan model under mixed_precision="bf16". The rest: the LRU
bound, re-sharding turned off, a direct rank call, torch.export's own guard, training at a new shape, and a
capture at another shape keeping whole what the first kept whole.
"""
from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import max_diff
from torch import nn

import tpcompile
from tpcompile.ops.guards import InputShapeError
from tpcompile.runtime.shape_cache import DEFAULT_MAX_SHAPES

VOCAB, D, HEADS = 64, 32, 4


class AlibiBlock(nn.Module):
    """Causal attention with an ALiBi bias whose distance table is built in Python from the length, then an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.register_buffer("slopes", torch.tensor([2.0 ** (-8.0 * (i + 1) / HEADS) for i in range(HEADS)]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, HEADS, C // HEADS).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(C, -1))
        like = dict(device=x.device, dtype=x.dtype)
        dist = torch.tensor([[float(j - i) for j in range(T)] for i in range(T)], **like)  # (T, T): fixes T
        bias = self.slopes[:, None, None] * dist.clamp(max=0) + torch.triu(torch.full((T, T), -1e9, **like), 1)
        att = (q @ k.transpose(-1, -2) / math.sqrt(C // HEADS) + bias.to(q.dtype)).softmax(-1)  # (B, H, T, T)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(B, T, C))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class AlibiLM(nn.Module):
    """Token ids -> logits through ALiBi blocks."""

    def __init__(self, layers: int = 1) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(AlibiBlock() for _ in range(layers))
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class EncoderLayer(nn.Module):
    """Post-norm self-attention with an additive padding mask, then an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (lin(x).view(B, T, HEADS, C // HEADS).transpose(1, 2) for lin in (self.q, self.k, self.v))
        s = q @ k.transpose(-1, -2) / math.sqrt(C // HEADS) + mask  # (B, H, T, T)
        x = self.ln1(x + self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C)))
        return self.ln2(x + self.down(F.relu(self.up(x))))


class MaskedEncoder(nn.Module):
    """An encoder whose padding mask is built one sample at a time (a loop over the batch fixes it)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.layer = EncoderLayer()
        self.pool = nn.Linear(D, D)

    def forward(self, ids: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        keep = padding_mask.bool()
        rows = [torch.where(keep[b][None, :], 0.0, -1e9) for b in range(ids.shape[0])]
        mask = torch.stack(rows)[:, None, :, :]  # (B, 1, 1, T)
        return self.pool(self.layer(self.emb(ids), mask)) * keep[..., None]


def _ids(shape: tuple[int, int], seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _padding(shape: tuple[int, int]) -> torch.Tensor:
    """1 for tokens, 0 for padding: sample b keeps its first T - b tokens (at least one)."""
    mask = torch.ones(shape)
    for b in range(shape[0]):
        mask[b, max(1, shape[1] - b):] = 0
    return mask


def _reshard_warnings(caught: list) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, tpcompile.TPCompileWarning)
            and "re-sharded" in str(w.message)]


def _shared(sm: Any, other: Any, name: str) -> bool:
    """Every rank of `other` holds the very parameter `name` of the same rank of sm."""
    return all(other.rank(r).get_parameter(name) is sm.rank(r).get_parameter(name) for r in range(sm.world_size))


def test_alibi_bias_runs_at_other_lengths_after_one_shard() -> None:
    """Sharded at length 12, the ALiBi model equals the original at lengths 9, 20, 7 (batches 3, 2, 4); one warning."""
    model = AlibiLM().eval()
    with pytest.warns(tpcompile.TPCompileWarning, match="dim 1 is fixed at 12"):
        sm = tpcompile.shard(model, 2, example_inputs=(_ids((2, 12)),))
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for shape in [(3, 9), (2, 20), (4, 7)]:
            ids = _ids(shape, seed=shape[1])
            outs = tpcompile.simulate(sm, ids)
            assert outs[0].shape == (*shape, VOCAB)
            assert max_diff(outs, model(ids)) < 1e-5, shape
        assert max_diff(tpcompile.simulate(sm, _ids((5, 9))), model(_ids((5, 9)))) < 1e-5  # length 9's capture
    said = _reshard_warnings(caught)
    assert len(said) == 1 and "AlibiLM" in said[0] and "input 'ids' 3x9" in said[0], said
    assert "fixed that dim at 12" in said[0] and f"up to {DEFAULT_MAX_SHAPES}" in said[0]
    assert sm.shapes.reshards == 3 and len(sm.shapes) == 3
    assert _shared(sm, sm.shapes.sharded_for(_ids((2, 20))), "blocks.0.qkv.weight")


def test_check_gradients_at_another_length_runs_its_capture() -> None:
    """check_gradients runs the ranks as tpcompile.simulate does: at a length the first capture's guards refuse, on
    the capture for it (sharing the first's weights); before, it raised the guard's InputShapeError."""
    model = AlibiLM().eval()
    with pytest.warns(tpcompile.TPCompileWarning, match="dim 1 is fixed at 12"):
        sm = tpcompile.shard(model, 2, example_inputs=(_ids((2, 12)),))
    with pytest.warns(tpcompile.TPCompileWarning, match="re-sharded"):
        report = tpcompile.check_gradients(model, sm, _ids((3, 9)))
    assert report.ok, str(report)
    assert sm.shapes.reshards == 1 and _shared(sm, sm.shapes.sharded_for(_ids((3, 9))), "blocks.0.qkv.weight")


def test_encoder_padding_mask_runs_at_other_batch_sizes_after_one_shard() -> None:
    """Sharded at batch 2, the encoder whose mask loops over the batch equals the original at batches 3, 5 and 4."""
    model = MaskedEncoder().eval()
    with pytest.warns(tpcompile.TPCompileWarning, match="dim 0 is fixed at 2"):
        sm = tpcompile.shard(model, 2, example_inputs=(_ids((2, 10)), _padding((2, 10))))
    with pytest.warns(tpcompile.TPCompileWarning, match="MaskedEncoder: called with input 'ids' 3x9"), \
            torch.no_grad():
        for shape in [(3, 9), (5, 14), (4, 6)]:
            ids, mask = _ids(shape, seed=shape[0]), _padding(shape)
            outs = tpcompile.simulate(sm, ids, padding_mask=mask)
            assert max_diff(outs, model(ids, mask)) < 1e-5, shape
    assert [dict(k)["ids"] for k in sm.shapes.keys()] == [(3, 9), (5, 14), (4, 6)]
    assert _shared(sm, sm.shapes.sharded_for(_ids((4, 6)), _padding((4, 6))), "layer.q.weight")


def test_falcon_mamba_runs_at_other_lengths_after_one_shard() -> None:
    """transformers' FalconMamba (slow scan, no kernels), sharded at length 6, equals it at lengths 4, 9 and 5."""
    transformers = pytest.importorskip("transformers")
    config = transformers.FalconMambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=1,
                                            expand=2, conv_kernel=3, time_step_rank=8, use_mambapy=False,
                                            use_cache=False)
    model = transformers.FalconMambaForCausalLM(config).eval()
    with pytest.warns(tpcompile.TPCompileWarning, match="dim 1 is fixed at 6"):
        sm = tpcompile.shard(model, 2, example_inputs=(_ids((2, 6)),))
    with pytest.warns(tpcompile.TPCompileWarning, match="re-sharded FalconMambaForCausalLM"), torch.no_grad():
        for shape in [(3, 4), (2, 9), (4, 5)]:
            ids = _ids(shape, seed=shape[1])
            outs = tpcompile.simulate(sm, ids)
            assert max_diff([o.logits for o in outs], model(ids).logits) < 1e-5, shape
    assert sm.shapes.reshards == 3
    assert _shared(sm, sm.shapes.sharded_for(_ids((2, 9))), "backbone.layers.0.mixer.in_proj.weight")


class LengthTable(nn.Module):
    """The smallest length-fixing model: a linear plus a per-position table built in Python."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = torch.tensor([float(t) for t in range(x.shape[1])])  # fixes dim 1
        return self.down(F.relu(self.up(x))) + table[:, None]


def _shard_table(**kwargs: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tpcompile.TPCompileWarning)
        return tpcompile.shard(LengthTable().eval(), 2, example_inputs=(torch.randn(2, 4, 8),), **kwargs)


def test_the_cache_keeps_at_most_max_shapes_least_recently_used_dropped() -> None:
    """max_shapes=2: after lengths 5, 6, 5, 7 the captures for 5 and 7 are kept; 6 is captured again, still equal."""
    sm = _shard_table()
    sm.shapes.max_shapes = 2
    model = sm.shapes.model
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", tpcompile.TPCompileWarning)
        for t in (5, 6, 5, 7, 6):
            x = torch.randn(3, t, 8)
            assert max_diff(tpcompile.simulate(sm, x), model(x)) < 1e-5, t
            assert len(sm.shapes) <= 2
    assert [dict(k)["x"][1] for k in sm.shapes.keys()] == [7, 6]
    assert sm.shapes.reshards == 4  # 5, 6, 7, then 6 again after it was dropped


def test_max_shapes_zero_and_direct_rank_calls_keep_the_guard_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """TPCOMPILE_MAX_SHAPES=0 turns re-sharding off, and sm.rank(r) called directly raises InputShapeError."""
    monkeypatch.setenv("TPCOMPILE_MAX_SHAPES", "0")
    sm = _shard_table()
    assert sm.shapes.max_shapes == 0
    with pytest.raises(tpcompile.TPCompileError, match="fixed that dim at 4"):
        tpcompile.simulate(sm, torch.randn(2, 5, 8))
    monkeypatch.setenv("TPCOMPILE_MAX_SHAPES", "two")
    with pytest.raises(tpcompile.TPCompileError, match="TPCOMPILE_MAX_SHAPES='two' is not a count"):
        _shard_table()
    monkeypatch.delenv("TPCOMPILE_MAX_SHAPES")
    sm = _shard_table()
    x = torch.randn(2, 5, 8)
    with pytest.raises(tpcompile.TPCompileError, match="InputShapeError.*fixed that dim at 4"):
        tpcompile.simulate_ranks(2, lambda r: sm.rank(r)(x))
    with torch.no_grad(), pytest.warns(tpcompile.TPCompileWarning, match="re-sharded LengthTable"):
        ranks = sm.shapes.sharded_for(x)  # the way out: the ShardedModel for these inputs
        assert max_diff(tpcompile.simulate_ranks(2, lambda r: ranks.rank(r)(x)), sm.shapes.model(x)) < 1e-5
    assert issubclass(InputShapeError, tpcompile.TPCompileError)


def test_training_at_a_new_shape_updates_the_shared_weights() -> None:
    """A step at length 6 on the re-sharded graphs moves the first capture's weights; length 4 then equals the model."""
    sm = _shard_table()
    model = sm.shapes.model.train()
    x, y = torch.randn(2, 6, 8), torch.randn(2, 4, 8)

    def step(r: int) -> None:
        gm = sm.shapes.sharded_for(x).rank(r)
        loss = gm(x).pow(2).mean()
        loss.backward()
        with torch.no_grad():
            for p in sm.rank(r).parameters():
                p -= 0.1 * p.grad
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tpcompile.TPCompileWarning)
        sm.shapes.sharded_for(x)  # re-sharded here, not on the rank threads
        tpcompile.simulate_ranks(2, step)
    model(x).pow(2).mean().backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
        assert max_diff(tpcompile.simulate(sm, y), model(y)) < 1e-5


class Branchy(nn.Module):
    """Another path for inputs longer than 8 tokens: torch.export guards the length, no dim is fixed."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        if ids.shape[1] > 8:
            h = h * 0.5
        return self.head(h)


def test_a_broken_export_guard_is_captured_again() -> None:
    """A length past torch.export's guard (a branch on it) runs on a capture of the other branch; shorter ones do not."""
    model = Branchy().eval()
    sm = tpcompile.shard(model, 2, example_inputs=(_ids((2, 6)),))
    with pytest.warns(tpcompile.TPCompileWarning, match=r"Guard failed: ids.size\(\)\[1\] <= 8"), torch.no_grad():
        assert max_diff(tpcompile.simulate(sm, _ids((3, 12))), model(_ids((3, 12)))) < 1e-5
    with torch.no_grad():
        assert max_diff(tpcompile.simulate(sm, _ids((2, 5))), model(_ids((2, 5)))) < 1e-5
    assert sm.shapes.reshards == 1


class LongInputsCumsum(nn.Module):
    """A cumulative sum over the MLP's hidden features (no split rule) only for inputs longer than 8 tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if x.shape[1] > 8:
            h = torch.cumsum(h, -1)
        return self.down(h)


def test_a_capture_at_another_shape_keeps_whole_what_the_first_kept_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """The long capture replicates `up` (the cumsum); the short one alone would split it, and its rank graphs
    could not share the first's weights: it keeps `up` whole from the start. The other way round refuses."""
    torch.manual_seed(0)
    model = LongInputsCumsum().eval()
    with pytest.warns(tpcompile.TPCompileWarning, match="replicating up"):
        sm = tpcompile.shard(model, 2, example_inputs=(torch.randn(2, 12, 16),))
    x = torch.randn(3, 5, 16)
    with pytest.warns(tpcompile.TPCompileWarning, match=r"Guard failed: x.size\(\)\[1\] >= 9"), torch.no_grad():
        assert max_diff(tpcompile.simulate(sm, x), model(x)) < 1e-5
    entry = sm.shapes.entry_for((x,), {})
    assert entry.sharded.plan.parameters["up.weight"].local_shape == (32, 16)
    short = tpcompile.shard(model, 2, example_inputs=(x,))
    assert short.plan.parameters["up.weight"].local_shape == (16, 16)  # alone, the short capture splits it
    with pytest.raises(tpcompile.TPCompileError, match="the capture for another input shape .* splits up.weight"):
        tpcompile.simulate(short, torch.randn(2, 12, 16))


class Scan(nn.Module):
    """A decaying running sum over the tokens written as a Python loop (it fixes the length), between linears."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.up, self.down = nn.Embedding(VOCAB, D), nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.up(self.emb(ids)))  # (B, T, 2D)
        state, outs = h[:, 0] * 0, []
        for t in range(ids.shape[1]):
            state = 0.5 * state + h[:, t]
            outs.append(state)
        return self.head(self.down(torch.stack(outs, 1)))


def _parallelize_at_other_shapes(rank: int) -> dict:
    """On each gloo rank: the ALiBi model (blocks checkpointed) parallelized at (2, 12), called at three other
    shapes with a backward each; the scan model in bfloat16 parallelized at (2, 6), called at (3, 9)."""
    import logging
    logs: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: logs.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("tpcompile").addHandler(handler)
    logging.getLogger("tpcompile").setLevel(logging.INFO)
    torch.manual_seed(0)
    alibi, scan = AlibiLM(layers=2).eval(), Scan().eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gm = tpcompile.parallelize(alibi, example_inputs=(_ids((2, 12)),), activation_checkpointing=True)
        outs = {}
        for shape in [(3, 9), (2, 16), (4, 9)]:
            out = gm(_ids(shape, seed=shape[1]))
            out.float().pow(2).mean().backward()
            outs[shape] = out.detach()
        low = tpcompile.parallelize(scan, example_inputs=(_ids((2, 6)),), mixed_precision="bf16", max_shapes=1)
        low_out = low(_ids((3, 9), seed=9))
        low_out.float().pow(2).mean().backward()
    agreed = [m for m in logs if "capture for a new input shape, plan and collective schedule" in m]
    return {"outs": outs, "warnings": _reshard_warnings(caught), "reshards": gm.meta["tpcompile"].shapes.reshards,
            "grads": [n for n, p in gm.named_parameters() if p.grad is None], "agreed": len(agreed),
            "low": low_out.detach().float(), "low_grads": {str(p.grad.dtype) for p in low.parameters()}}


@pytest.mark.gloo
def test_parallelize_reshards_on_every_rank_under_gloo() -> None:
    """2 gloo ranks: the rank module equals the model at 3 other shapes, each new graph agreed, its weights get
    the gradients; a bfloat16 rank module re-shards in bfloat16 onto its float32 masters."""
    from tpcompile.runtime import launch
    torch.manual_seed(0)
    alibi, scan = AlibiLM(layers=2).eval(), Scan().eval()
    results = launch(2, _parallelize_at_other_shapes, timeout=120)
    for rank, res in enumerate(results):
        assert res["reshards"] == 2, res["reshards"]  # (4, 9) runs on length 9's capture
        assert res["agreed"] == 3, res["agreed"]  # the startup agreement on each new graph before it computed
        assert len(res["warnings"]) == 2 and "AlibiLM: called with input 'ids' 3x9" in res["warnings"][0]
        assert not res["grads"], res["grads"]
        with torch.no_grad():
            for shape, out in res["outs"].items():
                assert float((out - alibi(_ids(shape, seed=shape[1]))).abs().max()) < 1e-5, (rank, shape)
            assert float((res["low"] - scan(_ids((3, 9), seed=9))).abs().max()) < 3e-2, rank
        assert res["low_grads"] == {"torch.float32"}


def test_a_dim_fixed_after_the_capture_is_guarded_and_said() -> None:
    """A dim a sharding pass fixes after the capture (comparing its symbolic size with a number fixes it at the
    example's size) joins the input guard, with a warning naming it: other sizes are refused (and captured again
    where users call rank graphs), not run on graphs built for the example's. pyproject.toml makes that warning an
    error everywhere else in the suite, so no pass may fix a dim unnoticed."""
    from tpcompile.capture import capture
    from tpcompile.capture.input_dims import guard_dims_fixed_later

    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    x = torch.randn(2, 6, 16)
    cap = capture(model, (x,), {}, None)
    before = cap.gm._tpcompile_input_guard.fixed  # the features (16), fixed by the weights
    guard_dims_fixed_later(cap.gm, (x,), {}, "Sequential")  # nothing fixed since: no warning, no new check
    assert [f.dim for f in cap.gm._tpcompile_input_guard.fixed] == [f.dim for f in before] == [2]
    holder = next(n for n in cap.gm.graph.nodes if n.op == "placeholder")
    assert int(holder.meta["val"].shape[1]) == 6  # what such a pass does to the length
    with pytest.warns(tpcompile.TPCompileWarning, match="input 'input_1' dim 1 was dynamic in the capture, but "
                                                        "sharding fixed it at 6"):
        guard_dims_fixed_later(cap.gm, (x,), {}, "Sequential")
    with pytest.raises(InputShapeError, match="has size 7 in dim 1, but the capture fixed that dim at 6"):
        cap.gm(torch.randn(2, 7, 16))
    assert cap.gm(torch.randn(3, 6, 16)).shape == (3, 6, 16)  # the batch stays free
