"""Dropout masks independent of the parallel layout: every rank's mask is its part of the unsharded tensor's mask."""
from __future__ import annotations

import copy
import dataclasses
import functools
import warnings
from types import SimpleNamespace

import pytest
import torch

import hf_models
import tpcompile
import tpcompile.ops.rng as rng
from hybrid_helpers import BATCH, TINY_GPT, batches, loss_fn
from tpcompile.api import shard_captured
from tpcompile.capture import Captured, capture
from tpcompile.layouts import within_cut
from tpcompile.models import GPT, GPTConfig
from tpcompile.passes.recompute import checkpoint_selective
from tpcompile.passes.rewrite_dropout import split_spec
from tpcompile.placement import (ParamSlice, Shard, local_shape, pad_cuts, piece_cut, piece_shard, rank_pieces,
                                 seg_cuts, slice_placement)

IDS = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(2))
HF = {"phi3": dict(attention_dropout=0.2, resid_pdrop=0.2, num_hidden_layers=1),  # fused q|k|v, 2 kv heads
      "gpt2": dict(attn_pdrop=0.2, resid_pdrop=0.2, embd_pdrop=0.2, n_layer=1),  # fused c_attn (Conv1D)
      "llama": dict(attention_dropout=0.2, num_hidden_layers=1)}


@functools.cache
def _captured(name: str) -> tuple[torch.nn.Module, Captured, dict]:
    """A model with dropout on in training mode, captured once per test process, and its keyword inputs."""
    if name in ("sdpa", "manual"):  # the bundled GPT: embedding, attention and residual dropout
        torch.manual_seed(0)
        model, kwargs = GPT(GPTConfig(dropout=0.2, attention=name)).train(), {"idx": IDS}
    else:  # a Hugging Face model with dropout in its config (padded vocabulary: 130 at ws 4)
        arch = next(a for a in hf_models.ARCHS + hf_models.NEW_ARCHS if a.name == name.split(":")[0])
        model = hf_models.build(arch, vocab_size=130, **HF[arch.name]).train()
        kwargs = hf_models.inputs(arch, 2, 8)
    return model, capture(model, (), kwargs), kwargs


def _outputs(name: str, world_size: int, *, sequence_parallel: bool = False, seed: int = 5) -> list[torch.Tensor]:
    """Every rank's output (logits of a ModelOutput) of one forward at `world_size` after rng.seed(seed)."""
    sm = _sharded(name, world_size, sequence_parallel)
    rng.seed(seed)
    outs = tpcompile.simulate(sm, **_captured(name)[2])
    return [o if isinstance(o, torch.Tensor) else o.logits for o in outs]


def _sharded(name: str, world_size: int, sequence_parallel: bool = False) -> tpcompile.ShardedModel:
    """The captured model sharded on its own copy of the graph (the passes annotate it in place)."""
    _, cap, _ = _captured(name)
    with warnings.catch_warnings():  # copying the graph's pytree spec warns about a torch-internal alias
        warnings.simplefilter("ignore", FutureWarning)
        gm = copy.deepcopy(cap.gm)
    return shard_captured(dataclasses.replace(cap, gm=gm), world_size, sequence_parallel=sequence_parallel)


@pytest.mark.parametrize("world_size,sequence_parallel", [(2, False), (4, False), (2, True), (4, True), (3, False),
                                                           (3, True), (5, True)])
@pytest.mark.parametrize("attention", ["sdpa", "manual"])
def test_gpt_masks_equal_world_size_one(attention: str, world_size: int, sequence_parallel: bool) -> None:
    """The GPT with dropout on gives, on every rank at ws 2, 3, 4 and 5 (heads, tokens split; its 4 heads padded to
    6 at 3 ranks; its 16 tokens in shares of 6|5|5 at 3 ranks, 4|3|3|3|3 at 5), the output of ws 1."""
    want = _outputs(attention, 1)[0]
    sm = _sharded(attention, world_size, sequence_parallel)
    masks = sum(n.target is torch.ops.tpcompile_rng.dropout_mask.default for n in sm.rank(1).graph.nodes)
    model = _captured(attention)[0]
    assert masks == 1 + 3 * model.config.n_layer  # embeddings; per block attention, its output, the MLP
    for out in _outputs(attention, world_size, sequence_parallel=sequence_parallel):
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # the masks really drop: far from the model without dropout
        assert (copy.deepcopy(model).eval()(IDS) - want).abs().max() > 0.1


@pytest.mark.parametrize("name,world_sizes", [("phi3", (4,)), pytest.param("phi3", (2,), marks=pytest.mark.slow),
                                               pytest.param("gpt2", (2, 4), marks=pytest.mark.slow)])
def test_hugging_face_masks_equal_world_size_one(name: str, world_sizes: tuple[int, ...]) -> None:
    """A Hugging Face model with dropout in its config: every rank at ws 2 and 4 gives the output of ws 1."""
    want = _outputs(name, 1)[0]
    for ws in world_sizes:
        for out in _outputs(name, ws):
            torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_grouped_query_sdpa_with_dropout(monkeypatch: pytest.MonkeyPatch) -> None:
    """SDPA with enable_gqa and dropout (Llama without a mask) is spelled out: ws 2 gives the output of ws 1."""
    monkeypatch.setenv("TRANSFORMERS_SDPA_FORCE_GQA", "1")  # read while the model is traced
    assert any(n.kwargs.get("enable_gqa") for n in _captured("llama:gqa")[1].gm.graph.nodes)
    want = _outputs("llama:gqa", 1)[0]
    for out in _outputs("llama:gqa", 2):
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


class _Twice(torch.nn.Module):
    """One dropout module called twice in one forward."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.drop = torch.nn.Linear(16, 64), torch.nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.up(x)
        return self.drop(h), self.drop(h)


def test_new_masks_per_call_and_per_site() -> None:
    """Two forwards draw two masks, and so do two calls of one dropout module within a forward."""
    x = torch.randn(8, 16)
    sm = tpcompile.shard(_Twice().train(), 2, example_inputs=(x,), plan={"up": "sharded_output"})
    rng.seed(1)
    first, second = tpcompile.simulate(sm, x), tpcompile.simulate(sm, x)
    for r in range(2):
        a, b = first[r]
        assert not torch.equal(a == 0, b == 0)  # two sites of one forward
        assert not torch.equal(a == 0, second[r][0] == 0)  # the same site in the next forward
        assert 0.3 < float((a == 0).float().mean()) < 0.7


def test_state_and_load_state_reproduce_a_forward() -> None:
    """rng.state() taken mid-run, then load_state() after other draws, gives the same next forward exactly."""
    sm = _sharded("sdpa", 2)
    rng.seed(11)
    tpcompile.simulate(sm, IDS)
    saved = rng.state()
    assert saved["seed"] == 11 and set(saved["calls"].values()) == {1} and len(saved["calls"]) == 7
    want = tpcompile.simulate(sm, IDS)
    tpcompile.simulate(sm, IDS)
    rng.load_state(saved)
    for got, ref in zip(tpcompile.simulate(sm, IDS), want):
        torch.testing.assert_close(got, ref, atol=0, rtol=0)
    with pytest.raises(tpcompile.TPCompileError, match="rng.state"):
        rng.load_state({"seed": 1})


def test_selective_recompute_keeps_the_masks() -> None:
    """Selective checkpointing with dropout: gradients equal those without it (no mask drawn again)."""
    sm, twin = _sharded("sdpa", 2), _sharded("sdpa", 2)
    for r in range(2):
        checkpoint_selective(twin.rank(r))

    def grads(model: tpcompile.ShardedModel) -> list[dict]:
        rng.seed(4)

        def run(r: int) -> dict:
            model.rank(r)(IDS).square().mean().backward()
            return {n: p.grad for n, p in model.rank(r).named_parameters()}
        return tpcompile.simulate_ranks(2, run)
    for got, want in zip(grads(twin), grads(sm)):
        for n in want:
            torch.testing.assert_close(got[n], want[n], atol=1e-6, rtol=1e-5)


def _mask(shape: list[int], placement: object, rank: int, ws: int, rows_of: list[int], batch: int,
          rows: int = 0) -> torch.Tensor:
    """The op's mask of site 't' at step 0 on one rank of a value of global `shape`, placed as `placement`."""
    local = list(local_shape(shape, placement, rank, ws))
    split = split_spec(SimpleNamespace(rank=rank, ws=ws), placement, shape)  # what the rewrite passes the op
    with rng.step(0), rng.rows(rows):
        return torch.ops.tpcompile_rng.dropout_mask(torch.ones(local), 0.5, "t", rank, split, rows_of, batch)


@pytest.mark.parametrize("sl", [ParamSlice(1), ParamSlice(1, segments=(8, 4, 4)), ParamSlice(1, cuts=pad_cuts(20, 4)),
                                piece_cut(1, 16, 2),
                                ParamSlice(1, (8, 4, 4), cuts=seg_cuts((8, 4, 4), 4, counts=(4, 2, 2))),
                                ParamSlice(1, (8, 4, 4), cuts=seg_cuts((8, 4, 4), 4, (8, 8, 8)))])
def test_each_split_kind_tiles_the_whole_mask(sl: ParamSlice) -> None:
    """Segments, kv pieces and a padded dim at 4 ranks: each rank's mask is the whole mask at its positions."""
    shape = [3, 18 if isinstance(sl.padded, int) else 16, 5]
    whole = _mask(shape, None, 0, 1, [0, 0, 0], 0)
    for r in range(4):
        local = _mask(shape, slice_placement(sl), r, 4, [0, 0, 0], 0)
        for start, at, n in rank_pieces(sl, shape[1], r, 4):  # (the padded dim's last rank: 3 of 5 are real)
            assert torch.equal(local[:, at:at + n], whole[:, start:start + n])


def test_tokens_heads_kv_pieces_and_rows_tile_the_whole_mask() -> None:
    """Tokens or heads (padded too) folded with the batch, kv pieces with split repeats, later rows of the batch: the
    whole mask."""
    whole = _mask([24, 8], None, 0, 1, [1, 0], 4).view(4, 6, 8)  # (batch x 6 tokens or heads, features), batch 4
    for r in range(2):
        tokens = _mask([24, 8], Shard(0, seq=True, outer=4), r, 2, [1, 0], 4)  # each row's tokens split in two
        assert torch.equal(tokens.view(4, 3, 8), whole[:, 3 * r:3 * r + 3])
        later = _mask([12, 8], Shard(0, seq=True, outer=2), r, 2, [1, 0], 2, rows=2)  # batch rows 2 and 3
        assert torch.equal(later.view(2, 3, 8), whole[2:, 3 * r:3 * r + 3])
        heads = _mask([12, 8], Shard(0, outer=2), r, 2, [1, 0], 2, rows=2)  # heads split, rows 2 and 3
        assert torch.equal(heads.view(2, 3, 8), whole[2:, 3 * r:3 * r + 3])
    for r in range(4):  # the 6 heads zero-padded to 8 at 4 ranks, folded with the batch: each rank's real heads
        padded = _mask([24, 8], Shard(0, outer=4, cuts=pad_cuts(8, 4)), r, 4, [1, 0], 4).view(4, 2, 8)
        real = max(0, min(2, 6 - 2 * r))
        assert torch.equal(padded[:, :real], whole[:, 2 * r:2 * r + real])
    kv = _mask([4, 2, 6, 5], None, 0, 1, [1, 0, 0, 0], 4)  # (batch, 2 kv heads, 6 repeats, head dim)
    for r in range(4):  # 2 pieces of one kv head, each shared by 2 ranks that split its repeats
        local = _mask([2, 2, 6, 5], piece_shard(1, 2, 2, within=within_cut(6, 2)), r, 4, [1, 0, 0, 0], 2, rows=2)
        assert torch.equal(local, kv[2:, r // 2:r // 2 + 1, 3 * (r % 2):3 * (r % 2) + 3])


def _hybrid_rank(rank: int, layouts: list[tuple[int, int, int]], steps: int) -> list[list[float]]:
    """Each layout (dp, tp, pp) in turn: the tiny GPT with dropout trained by parallelize_train; its losses."""
    out = []
    for dp, tp, pp in layouts:
        torch.manual_seed(0)
        model = GPT(GPTConfig(**TINY_GPT, dropout=0.1)).to(torch.float64).train()
        mesh = tpcompile.init_mesh(dp=dp, tp=tp, pp=pp)
        d, per, data = mesh["dp"].get_local_rank(), BATCH // dp, batches(steps)
        hm = tpcompile.parallelize_train(model, mesh, loss_fn=loss_fn, example_inputs=(data[0][:per],),
                                         microbatches=2, check=False)  # (the startup agreement is tested elsewhere)
        opt = torch.optim.AdamW(hm.parameters(), lr=1e-2)
        rng.seed(3)
        losses = []
        for ids in data:
            mine = ids[d * per:(d + 1) * per]
            opt.zero_grad()
            losses.append(hm.step(mine, target=mine).item())
            opt.step()
        out.append(losses)
    return out


def _plain_losses(steps: int) -> list[float]:
    """The same model at (1, 1, 1): sharded at world size 1, whole batches, step i's masks."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY_GPT, dropout=0.1)).to(torch.float64).train()
    data = batches(steps)
    gm = tpcompile.shard(model, 1, example_inputs=(data[0],)).rank(0)
    opt = torch.optim.AdamW(gm.parameters(), lr=1e-2)
    rng.seed(3)

    def run(_: int) -> list[float]:
        losses = []
        for i, ids in enumerate(data):
            opt.zero_grad()
            with rng.step(i):
                loss = loss_fn(gm(ids), ids)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses
    return tpcompile.simulate_ranks(1, run)[0]


@pytest.mark.gloo
def test_hybrid_layouts_train_like_one_process() -> None:
    """parallelize_train with dropout at (1,2,1), (2,1,1), (1,1,2), 2 microbatches: the (1,1,1) losses within 1e-6."""
    from tpcompile.runtime.launch import launch
    layouts = [(1, 2, 1), (2, 1, 1), (1, 1, 2)]
    want = _plain_losses(3)
    with torch.no_grad():  # dropout changes the loss: a check that the masks are on
        torch.manual_seed(0)
        model = GPT(GPTConfig(**TINY_GPT, dropout=0.1)).to(torch.float64).eval()
        assert abs(loss_fn(model(batches(1)[0]), batches(1)[0]).item() - want[0]) > 1e-3
    ranks = launch(2, _hybrid_rank, layouts, 3, timeout=240)
    for k, layout in enumerate(layouts):
        for losses in (ranks[0][k], ranks[1][k]):
            assert losses == pytest.approx(want, rel=1e-6), layout


@pytest.mark.slow
@pytest.mark.gloo
def test_hybrid_four_ranks_train_like_one_process() -> None:
    """With dropout at (2,1,2), (2,2,1) and (1,2,2), 2 microbatches, on 4 gloo ranks: the (1,1,1) losses within 1e-6."""
    from tpcompile.runtime.launch import launch
    layouts = [(2, 1, 2), (2, 2, 1), (1, 2, 2)]
    want = _plain_losses(3)
    ranks = launch(4, _hybrid_rank, layouts, 3, timeout=600)
    for k, layout in enumerate(layouts):
        for rank in ranks:
            assert rank[k] == pytest.approx(want, rel=1e-6), layout
