"""Checkpoints of the whole training state (tpcompile.dcp): optimizer, step, extra, RNG; complete or refused.

In-process cases use the plain model in one process; one 2-process gloo launch saves at (dp, tp, pp)
= (1, 2, 1) and resumes at (2, 1, 1) with FSDP, and trains a tpcompile.parallelize rank module; the
test process resumes both checkpoints in the plain model. The (2, 1, 2) case and the kill-and-relaunch
test run examples/train_hybrid.py under torchrun (tests/test_hybrid_matrix.py, tests/test_restart.py).
"""
from __future__ import annotations

import functools
import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as stock_dcp

import tpcompile
import tpcompile.dcp as tdcp
from hybrid_helpers import batches, build, loss_fn, reference, relative
from train_state_ranks import LR, shifted

STEPS = 6


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, data: list[torch.Tensor]) -> list[float]:
    """Plain AdamW steps; the losses."""
    losses = []
    for ids in data:
        opt.zero_grad()
        loss = loss_fn(model(ids), ids)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _resumed_plain(path: str) -> list[float]:
    """The plain GPT (weights moved) loaded from `path` with a fresh AdamW, trained to step STEPS."""
    model = shifted("gpt")
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)  # the checkpoint's lr must replace it
    start = tdcp.load(model, path, optimizer=opt)["step"]
    assert opt.param_groups[0]["lr"] == LR
    return _train(model, opt, batches(STEPS)[start:])


def test_plain_model_resumes_exactly(tmp_path: Path) -> None:
    """3 steps, save_step, resume into a moved model with a fresh AdamW, 3 more: bit-equal to 6 uninterrupted."""
    want = reference("gpt", STEPS, lr=LR)["losses"]
    model = build("gpt")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    first = _train(model, opt, batches(STEPS)[:3])
    path = tdcp.save_step(model, tmp_path, 3, optimizer=opt, extra={"data": {"epoch": 0, "index": 3}})
    assert os.path.basename(path) == "step_000003" and tdcp.latest(tmp_path) == path
    again = shifted("gpt")
    opt2 = torch.optim.AdamW(again.parameters(), lr=1.0)
    assert tdcp.resume(again, tmp_path, optimizer=opt2) == 3
    assert first + _train(again, opt2, batches(STEPS)[3:]) == want
    assert tdcp.load(again, path)["extra"] == {"data": {"epoch": 0, "index": 3}}


def test_extra_must_be_json(tmp_path: Path) -> None:
    """A tensor in extra= is refused before anything is written, naming where it is and what to do."""
    model = torch.nn.Linear(2, 2)
    with pytest.raises(tpcompile.TPCompileError, match=r"extra\['best'\]\[1\] is a torch.Tensor.*\.tolist\(\)"):
        tdcp.save(model, tmp_path / "c", extra={"best": [1.0, torch.ones(2)]})
    assert not (tmp_path / "c").exists()


def _linear_checkpoint(path: Path, out: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A one-weight model after one AdamW step, saved with its optimizer to `path`."""
    model = torch.nn.Linear(4, out, bias=False)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    tdcp.save(model, path, optimizer=opt, step=1)
    return model, opt


def test_incomplete_checkpoints_are_skipped_and_refused(tmp_path: Path) -> None:
    """A step directory without the .complete marker: latest() skips it, load names it, prune leaves it if newest."""
    for step in (2, 4, 6):
        _linear_checkpoint(Path(tdcp.step_dir(tmp_path, step)))
    os.remove(tmp_path / "step_000006" / ".complete")  # as if a rank died while step 6 was written
    assert tdcp.latest(tmp_path) == str(tmp_path / "step_000004")
    with pytest.raises(tpcompile.TPCompileError, match=r"step_000006' is incomplete.*\.complete.*latest"):
        tdcp.load(torch.nn.Linear(4, 3, bias=False), tmp_path / "step_000006")
    assert tdcp.prune(tmp_path, 1) == [str(tmp_path / "step_000002")]
    assert sorted(os.listdir(tmp_path)) == ["step_000004", "step_000006"]


def test_optimizer_from_a_weights_only_checkpoint_is_refused(tmp_path: Path) -> None:
    """Stock DCP of the weights: tpcompile.dcp.load reads the weights, and with optimizer= says it has none."""
    model = torch.nn.Linear(4, 3)
    stock_dcp.save(model.state_dict(), checkpoint_id=str(tmp_path), no_dist=True)
    other = torch.nn.Linear(4, 3)
    assert tdcp.load(other, tmp_path) == {"step": None, "extra": None}
    assert torch.equal(other.weight, model.weight)
    with pytest.raises(tpcompile.TPCompileError, match="holds no optimizer state.*without optimizer="):
        tdcp.load(other, tmp_path, optimizer=torch.optim.AdamW(other.parameters()))


def test_mismatch_names_optimizer_tensors(tmp_path: Path) -> None:
    """Another shape names the weight and its moments; a moment the record lists but the files lack is named."""
    _linear_checkpoint(tmp_path / "a")
    wide = torch.nn.Linear(4, 5, bias=False)
    with pytest.raises(tpcompile.TPCompileError, match=r"optim\.state\.weight\.exp_avg \[3, 4\] in the checkpoint vs "
                                                       r"\[5, 4\]"):
        tdcp.load(wide, tmp_path / "a", optimizer=torch.optim.AdamW(wide.parameters()))
    record = json.loads((tmp_path / "a" / "tpcompile.json").read_text())
    record["optimizer"]["state"]["weight"]["momentum"] = {"tensor": "param"}
    (tmp_path / "a" / "tpcompile.json").write_text(json.dumps(record))
    same = torch.nn.Linear(4, 3, bias=False)
    with pytest.raises(tpcompile.TPCompileError, match=r"not in it: optim\.state\.weight\.momentum \[3, 4\]"):
        tdcp.load(same, tmp_path / "a", optimizer=torch.optim.AdamW(same.parameters()))


def test_torch_rng_state_comes_back(tmp_path: Path) -> None:
    """With step=, the global generator's state is saved; load restores it (rng=False leaves the current one)."""
    model = torch.nn.Linear(2, 2)
    torch.manual_seed(7)
    tdcp.save(model, tmp_path, step=0)
    want = torch.rand(4)
    torch.rand(100)
    tdcp.load(model, tmp_path, rng=False)
    assert not torch.equal(torch.rand(4), want)
    tdcp.load(model, tmp_path)
    assert torch.equal(torch.rand(4), want)


@functools.cache
def _launch() -> tuple[dict, str, str]:
    """One 2-process launch: save at (1, 2, 1) after 3 steps, resume at (2, 1, 1) to 6; a rank module's 3 steps."""
    from tpcompile.runtime import launch
    root = tempfile.mkdtemp(prefix="tpcompile-train-state-")
    hybrid_dir, module_dir = os.path.join(root, "hybrid"), os.path.join(root, "module")
    runs = [{"layout": (1, 2, 1), "end": 3, "dir": hybrid_dir, "save": True},
            {"layout": (2, 1, 1), "end": STEPS, "dir": hybrid_dir, "shift": True}]
    import train_state_ranks
    ranks = launch(2, train_state_ranks.runs, runs, module_dir, 3, timeout=300)
    return ranks[0], hybrid_dir, module_dir


@pytest.mark.gloo
def test_saved_at_121_resumes_at_211_like_six_steps() -> None:
    """(1, 2, 1) for 3 steps, resumed by FSDP at (2, 1, 1) for 3 more: the 6 single-process losses (float64)."""
    want = reference("gpt", STEPS, lr=LR)["losses"]
    saved, resumed = _launch()[0]["hybrid"]
    assert saved["start"] == 0 and resumed["start"] == 3
    got = saved["losses"] + resumed["losses"]
    assert max(relative(a, b) for a, b in zip(got, want)) < 1e-9, (got, want)


@pytest.mark.gloo
def test_checkpoints_of_ranks_resume_in_the_plain_model() -> None:
    """The (1, 2, 1) HybridModel's and a 2-rank parallelize module's checkpoints, resumed in one plain process."""
    want = reference("gpt", STEPS, lr=LR)["losses"]
    ranks, hybrid_dir, module_dir = _launch()
    assert max(relative(a, b) for a, b in zip(ranks["module"], want[:3])) < 1e-9
    for path in (tdcp.latest(hybrid_dir), module_dir):
        got = _resumed_plain(path)
        assert max(relative(a, b) for a, b in zip(got, want[3:])) < 1e-9, (path, got, want[3:])


@pytest.mark.gloo
def test_optimizer_moments_are_chunked_like_their_weight() -> None:
    """In the (1, 2, 1) checkpoint a fused q|k|v weight's exp_avg has the weight's global shape and chunks."""
    _, hybrid_dir, _ = _launch()
    md = stock_dcp.FileSystemReader(tdcp.latest(hybrid_dir)).read_metadata().state_dict_metadata
    name = "transformer.h.0.attn.c_attn.weight"
    weight, moment = md[name], md[f"optim.state.{name}.exp_avg"]
    assert tuple(moment.size) == tuple(weight.size)
    assert sorted(tuple(c.offsets) for c in moment.chunks) == sorted(tuple(c.offsets) for c in weight.chunks)
    assert len(weight.chunks) == 6  # q|k|v segments, each split over 2 TP ranks
    assert tuple(md[f"optim.state.{name}.step"].size) == ()
