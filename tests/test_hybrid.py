"""Hybrid parallelism: the graph split, stages and checkpoint chunks in-process, and one 4-process gloo launch.

The full matrix of layouts, models and data-parallel modes is tests/test_hybrid_matrix.py
(pytest -m hybrid), whose results docs/hybrid.md records.
"""
from __future__ import annotations

import functools
import math
import tempfile

import pytest
import torch
from torch.utils import _pytree as pytree

import tpcompile
from hybrid_helpers import batches, build, inputs, load_plain, loss_fn, model_bytes, reference, relative
from tpcompile.api import shard_captured
from tpcompile.capture import Captured, capture
from tpcompile.hybrid.checkpoint import TensorSpec, local_chunks
from tpcompile.hybrid.partition import balanced_split, group_pieces, stage_io
from tpcompile.hybrid.pieces import find_blocks, split_pieces
from tpcompile.hybrid.stage import build_stage
from tpcompile.passes.rank_module import local_tensor as rank_local
from tpcompile.placement import ParamSlice, pad_cuts, piece_cut, seg_cuts


@functools.cache
def _captured(name: str) -> tuple[torch.nn.Module, Captured, tuple, dict]:
    """The tiny model, captured once per test process (each test splits it afresh)."""
    model = build(name)
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(3))
    a, k = inputs(name, ids)
    return model, capture(model, a, k), a, k


def _logits(out: object) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits


def test_sharded_pieces_equal_the_model() -> None:
    """Llama's pieces sharded by tpcompile over 2 simulated ranks: the composed ranks give the model's logits."""
    model, cap, a, k = _captured("llama")
    pieces = split_pieces(cap.gm, find_blocks(model))
    assert [p.block for p in pieces] == [False, True, True, True, True, False]
    assert all(len(p.inputs) == 1 for p in pieces[1:])  # the mask, rotary table and sizes are recomputed
    sms = [shard_captured(Captured(p.gm, p.name, (), {}, cap.module_paths), 2) for p in pieces]
    ranks = [[sm.rank(r) for sm in sms] for r in range(2)]
    assert sms[1].plan.parameters["model.layers.0.mlp.gate_proj.weight"].dim == 0  # the blocks really are split
    placeholders = [n for n in cap.gm.graph.nodes if n.op == "placeholder"]

    def run(r: int) -> torch.Tensor:
        env = dict(zip(placeholders, pytree.tree_leaves((a, k))))
        for p, gm in zip(pieces, ranks[r]):
            env.update(zip(p.outputs, gm(*[env[i] for i in p.inputs])))
        return env[next(n for n in cap.gm.graph.nodes if n.op == "output").args[0][0]]

    want = _logits(model(*a, **k))
    for out in tpcompile.simulate_ranks(2, run):
        assert torch.allclose(out, want, rtol=0, atol=1e-12)


def test_stages_own_block_parameters_under_the_model_names() -> None:
    """Two stages of the GPT: blocks are called submodules owning their weights, names are the model's, output equal."""
    model, cap, a, _ = _captured("gpt")
    pieces = split_pieces(cap.gm, find_blocks(model))
    stages = group_pieces(pieces, 2)
    placeholders = [n for n in cap.gm.graph.nodes if n.op == "placeholder"]
    outputs = list(next(n for n in cap.gm.graph.nodes if n.op == "output").args[0])
    io = stage_io(stages, placeholders, outputs)
    built = []
    for s, group in enumerate(stages):
        ranked = [shard_captured(Captured(p.gm, p.name, (), {}, cap.module_paths), 1).rank(0) for p in group]
        built.append(build_stage(s, group, ranked, *io[s]))
    block = built[0].get_submodule("transformer.h.0")
    assert "attn.c_attn.weight" in dict(block.named_parameters())
    assert "transformer.h.0.attn.c_attn.weight" in dict(built[0].named_parameters())
    names = [set(dict(s.named_parameters())) for s in built]
    assert names[0] | names[1] == set(dict(model.named_parameters()))
    assert names[0] & names[1] == {"transformer.wte.weight"}  # the tied embedding / head: a copy in each stage
    out = tpcompile.simulate_ranks(1, lambda r: built[1](built[0](*a)))[0]
    assert torch.equal(out, model(*a))


def test_balanced_split_minimises_the_largest_stage() -> None:
    """Costs 1, 4, 4, 4, 4, 1 in four stages: the light ends join the blocks beside them; too many stages fail."""
    assert balanced_split([1, 4, 4, 4, 4, 1], 4) == [2, 1, 1, 2]
    assert balanced_split([5, 1, 1, 1, 1, 5], 3) == [1, 4, 1]
    with pytest.raises(tpcompile.TPCompileError, match="need at least 7 pieces"):
        balanced_split([1] * 6, 7)


@pytest.mark.parametrize("dim", [0, 1])
def test_rank_chunks_tile_the_full_tensor(dim: int) -> None:
    """TP cut (fused q|k|v segments) x FSDP rows: every (tp, dp) rank's chunks cover each element exactly once."""
    full = torch.arange(12 * 6, dtype=torch.float64).view(12, 6) if dim == 0 else torch.arange(6 * 12.).view(6, 12)
    spec = TensorSpec("w", ("w",), tuple(full.shape), ParamSlice(dim, segments=(4, 4, 4)))
    count = torch.zeros_like(full)
    for tp_rank in range(2):
        local = torch.cat([full.narrow(dim, s + 2 * tp_rank, 2) for s in (0, 4, 8)], dim)  # q|k|v pieces
        for dp_rank in range(3):
            rows = local.tensor_split(3)[dp_rank]
            row0 = sum(len(r) for r in local.tensor_split(3)[:dp_rank])
            for offsets, view in local_chunks(rows, row0, spec, tp_rank, 2):
                region = full[tuple(slice(o, o + n) for o, n in zip(offsets, view.shape))]
                assert torch.equal(region, view)
                count[tuple(slice(o, o + n) for o, n in zip(offsets, view.shape))] += 1
    assert torch.equal(count, torch.ones_like(full))


SHARED_CUTS = {  # at tp 4: k and v rows of a fused q|k|v in 2 pieces; kv heads in 2 pieces; a padded dim; whole
    "fused q|k|v, kv pieces": ParamSlice(0, (8, 4, 4), cuts=seg_cuts((8, 4, 4), 4, counts=(4, 2, 2))),
    "kv pieces": piece_cut(0, 16, 2), "padded": ParamSlice(0, cuts=pad_cuts(12, 4)), "whole": None}


@pytest.mark.parametrize("name", sorted(SHARED_CUTS))
def test_owned_chunks_count_each_element_once(name: str) -> None:
    """What a gradient norm counts (`owned`): over 4 TP ranks x 3 FSDP rows each element exactly once, a piece
    several TP ranks hold on one of them (all of its chunks would count those rows twice)."""
    sl = SHARED_CUTS[name]
    full = torch.arange(16 * 3, dtype=torch.float64).view(16, 3)[:10 if name == "padded" else 16]
    spec = TensorSpec("w", ("w",), tuple(full.shape), sl)
    counts = {owned: torch.zeros_like(full) for owned in (True, False)}
    for tp_rank in range(4):
        local = rank_local(full, sl, tp_rank, 4)
        for dp_rank, rows in enumerate(local.tensor_split(3)):
            row0 = sum(len(r) for r in local.tensor_split(3)[:dp_rank])
            for owned, count in counts.items():
                for offsets, view in local_chunks(rows, row0, spec, tp_rank, 4, owned=owned):
                    region = tuple(slice(o, o + n) for o, n in zip(offsets, view.shape))
                    assert torch.equal(full[region], view)
                    count[region] += 1
    assert torch.equal(counts[True], torch.ones_like(full))
    assert counts[False].max() == {"padded": 1, "whole": 4}.get(name, 2)


def test_init_mesh_and_parallelize_train_check_their_arguments() -> None:
    """Bad degrees, a missing launch and a mesh of the wrong kind are TPCompileErrors saying what to pass."""
    with pytest.raises(tpcompile.TPCompileError, match="dp must be an int >= 1"):
        tpcompile.init_mesh(dp=0)
    with pytest.raises(tpcompile.TPCompileError, match="torchrun --nproc-per-node 4"):
        tpcompile.init_mesh(dp=2, tp=2)
    with pytest.raises(tpcompile.TPCompileError, match="DeviceMesh of tpcompile.init_mesh"):
        tpcompile.parallelize_train(build("gpt"), None, loss_fn=lambda o, t: o.sum())


LAYOUTS = [(2, 1, 2), (1, 2, 2)]  # (dp, tp, pp): FSDP over 2 with 2 stages; TP over 2 with 2 stages


@functools.cache
def _runs() -> tuple[list[list[dict]], dict, str]:
    """One 4-process gloo launch training the GPT at both LAYOUTS (FSDP, 1F1B, clipped); a checkpoint of the first."""
    from hybrid_helpers import hybrid_runs
    from tpcompile.runtime import launch
    path = tempfile.mkdtemp(prefix="tpcompile-hybrid-")
    runs = [{"layout": layout, "name": "gpt", "steps": 3, "clip": 0.5, "save": path if i == 0 else None}
            for i, layout in enumerate(LAYOUTS)]
    by_rank = launch(4, hybrid_runs, runs, timeout=300)
    return [[r[i] for r in by_rank] for i in range(len(LAYOUTS))], reference("gpt", 3, clip=0.5), path


@pytest.mark.gloo
@pytest.mark.parametrize("at", range(len(LAYOUTS)), ids=[str(t) for t in LAYOUTS])
def test_hybrid_training_equals_the_single_process_reference(at: int) -> None:
    """4 gloo ranks at (2, 1, 2) and (1, 2, 2): every rank's losses and clipped global norms equal one process's."""
    runs, ref, _ = _runs()
    for r in runs[at]:
        assert max(relative(a, b) for a, b in zip(r["losses"], ref["losses"])) < 1e-9
        assert max(relative(a, b) for a, b in zip(r["norms"], ref["norms"])) < 1e-9


@pytest.mark.gloo
def test_clipped_norm_counts_rows_shared_by_ranks_once() -> None:
    """Phi-3's fused q|k|v with 2 kv heads at tp 4 (4 gloo ranks): its k and v rows are held by 2 ranks each, yet
    the clipped global norms, and so the losses, equal one process's (each shared row counted on one rank)."""
    from hybrid_helpers import hybrid_runs
    from tpcompile.runtime import launch
    by_rank = launch(4, hybrid_runs, [{"layout": (1, 4, 1), "name": "phi3", "steps": 2, "clip": 0.01}], timeout=300)
    ref = reference("phi3", 2, clip=0.01)
    for (r,) in by_rank:
        assert max(relative(a, b) for a, b in zip(r["norms"], ref["norms"])) < 1e-9, (r["norms"], ref["norms"])
        assert max(relative(a, b) for a, b in zip(r["losses"], ref["losses"])) < 1e-9


@pytest.mark.gloo
def test_checkpoint_holds_the_trained_model_at_its_global_shapes() -> None:
    """The DCP checkpoint saved at (2, 1, 2) loads into the plain model with stock DCP: the reference's weights."""
    _, ref, path = _runs()
    got = load_plain("gpt", path)
    assert got.keys() == ref["state"].keys()
    for name, want in ref["state"].items():
        assert torch.allclose(got[name], want, rtol=0, atol=1e-9), name


@pytest.mark.gloo
@pytest.mark.parametrize("at", range(len(LAYOUTS)), ids=[str(t) for t in LAYOUTS])
def test_tied_weight_copies_stay_equal_across_stages(at: int) -> None:
    """The GPT's tied embedding / LM head has a copy in stage 0 and stage 1: after training the copies are equal."""
    runs, _, _ = _runs()
    by_place: dict = {}
    for r in runs[at]:
        by_place.setdefault((r["coords"]["dp"], r["coords"]["tp"]), []).append(dict(r["tied"]))
    for copies in by_place.values():
        assert len(copies) == 2 and copies[0].keys() == copies[1].keys()
        assert all(torch.equal(copies[0][k], copies[1][k]) for k in copies[0])


@pytest.mark.gloo
def test_fsdp_ranks_hold_a_quarter_of_the_parameters() -> None:
    """At (2, 1, 2) each rank holds its dp shard of its stage between steps: about 1/4 of the model's bytes."""
    runs, _, _ = _runs()
    ideal = model_bytes("gpt") / 4
    for pp in (0, 1):
        stage = [r for r in runs[0] if r["coords"]["pp"] == pp]
        assert sum(r["param_bytes"] for r in stage) == stage[0]["tp_local_bytes"]  # shards tile, no padding held
    worst = max(r["param_bytes"] for r in runs[0]) / ideal
    assert worst < 1.2, worst  # the excess: the tied weight's second copy, stage imbalance


@pytest.mark.gloo
def test_one_process_mesh_trains_llama_like_the_plain_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-process mesh (plain python): Llama's ModelOutput, GPipe microbatches, 2- and inf-norm clipping as torch."""
    import torch.distributed as dist
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.setenv(key, "x")  # recorded as absent, so the test leaves the environment as it was
        monkeypatch.delenv(key)
    mesh = tpcompile.init_mesh()
    try:
        ref_model, data = build("llama"), [b[:4] for b in batches(2)]
        hm = tpcompile.parallelize_train(build("llama"), mesh, loss_fn=loss_fn, microbatches=2, schedule="GPipe",
                                         example_kwargs=inputs("llama", data[0])[1])
        assert dict(hm.named_parameters()).keys() == dict(ref_model.named_parameters()).keys()
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (hm, ref_model)]
        for ids, norm_type in zip(data, (2.0, math.inf)):
            for opt in opts:
                opt.zero_grad()
            got = hm.step(input_ids=ids, use_cache=False, target=ids)
            want = loss_fn(ref_model(input_ids=ids, use_cache=False), ids)
            want.backward()
            assert relative(got.item(), want.item()) < 1e-12
            norm = hm.clip_grad_norm_(0.1, norm_type=norm_type)
            want_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.1, norm_type)
            assert relative(norm.item(), want_norm.item()) < 1e-12
            for opt in opts:
                opt.step()
        for name, p in hm.named_parameters():
            assert torch.allclose(p.full_tensor(), ref_model.get_parameter(name), rtol=0, atol=1e-12), name
    finally:
        dist.destroy_process_group()
