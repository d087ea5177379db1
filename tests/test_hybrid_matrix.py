"""The hybrid matrix (pytest -m hybrid, ~30-60 min on 2 cores): examples/train_hybrid.py under torchrun on gloo.

Every run trains 5 AdamW steps with gradients clipped to norm 1.0 and must give the losses and
global gradient norms of the single-process reference (same script, plain python, --dp 1 --tp 1
--pp 1) within 1e-5 relative, on every rank. docs/hybrid.md records the results.
"""
from __future__ import annotations

import functools
import math
import tempfile
from pathlib import Path

import pytest
import torch

from hybrid_helpers import build, meta_rank, relative
from hybrid_helpers import reference as tiny_reference
from hybrid_matrix import COMMON, LAYOUTS, MODELS, TOLERANCE, layout_args, record, run_example, worst_relative

pytestmark = [pytest.mark.hybrid, pytest.mark.gloo]

SCHEDULES = [("gpt", "Interleaved1F1B", "fsdp"), ("gpt", "GPipe", "ddp"), ("hf:llama", "Interleaved1F1B", "ddp"),
             ("hf:llama", "GPipe", "fsdp")]
OPTIONS = [("--activation-checkpointing",), ("--sequence-parallel",)]


@functools.cache
def reference(model: str, inputs: str = "8x16:long") -> dict:
    """The single-process run of the same script: the losses and norms every layout must give."""
    args = [a if a != "8x16:long" else inputs for a in COMMON]
    return run_example(["--dp", "1", "--tp", "1", "--pp", "1", "--model", model, *args])


def _train(model: str, layout: tuple[int, int, int], data_parallel: str, schedule: str = "1F1B",
           options: tuple[str, ...] = (), inputs: str = "8x16:long") -> dict:
    """Run one layout, record it, and compare it with the reference."""
    args = [a if a != "8x16:long" else inputs for a in COMMON]
    out = run_example(["--model", model, *layout_args(*layout), "--data-parallel", data_parallel,
                       "--schedule", schedule, *options, *args], nproc=math.prod(layout))
    ref = reference(model, inputs)
    row = {**out, "loss_diff": worst_relative(out["losses"], ref["losses"]),
           "norm_diff": worst_relative(out["grad_norms"], ref["grad_norms"]), "options": " ".join(options)}
    record("train", row)
    assert row["loss_diff"] < TOLERANCE, (out["losses"], ref["losses"])
    assert row["norm_diff"] < TOLERANCE, (out["grad_norms"], ref["grad_norms"])
    if data_parallel == "fsdp":  # each rank: its dp shard of its stage's TP slices
        assert max(out["param_bytes_per_rank"]) < 1.5 * out["model_param_bytes"] / out["world_size"]
    return out


@pytest.mark.parametrize("data_parallel", ["fsdp", "ddp"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("model", MODELS)
def test_layout_gives_the_reference_losses(model: str, layout: tuple[int, int, int], data_parallel: str) -> None:
    """8 gloo processes at (dp, tp, pp): losses and clipped norms equal the single process's within 1e-5."""
    _train(model, layout, data_parallel)


@pytest.mark.parametrize("model, schedule, data_parallel", SCHEDULES)
def test_schedule_gives_the_reference_losses(model: str, schedule: str, data_parallel: str) -> None:
    """Interleaved 1F1B (two stages per rank) and GPipe at (2, 2, 2) give the reference losses too."""
    _train(model, (2, 2, 2), data_parallel, schedule)


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: o[0].strip("-"))
def test_option_gives_the_reference_losses(options: tuple[str, ...]) -> None:
    """Activation checkpointing and sequence parallelism at (2, 2, 2) leave the losses as they were."""
    _train("gpt", (2, 2, 2), "fsdp", options=options)


def test_sixteen_processes() -> None:
    """16 gloo processes at (dp, tp, pp) = (4, 2, 2), the brief's layout, on a 16-sequence batch."""
    _train("gpt", (4, 2, 2), "fsdp", inputs="16x16:long")


def _plain_state(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint read into the plain example model with stock torch.distributed.checkpoint."""
    import torch.distributed.checkpoint as dcp
    from tpcompile.models.spec import load_model
    model = load_model("gpt", {"n_layer": 4})[0]
    state = model.state_dict()
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return {k: v.clone() for k, v in state.items()}


@pytest.mark.parametrize("layout", [(1, 4, 1), (2, 1, 2), (1, 1, 1)], ids=lambda t: "x".join(map(str, t)))
def test_checkpoint_saved_at_222_loads_at(layout: tuple[int, int, int], tmp_path: Path) -> None:
    """Saved at (2, 2, 2) after 2 steps: loaded at another layout, the tensors are the saved ones, and 2 more
    steps give the losses of the single process that loaded it."""
    base = _saved_222()
    again = tmp_path / "again"
    procs = math.prod(layout) if layout != (1, 1, 1) else None
    common = ["--model", "gpt", "--layers", "4", "--inputs", "8x16:long", "--json", "--load", str(base)]
    run_example([*layout_args(*layout), *common, "--steps", "0", "--save", str(again)], nproc=procs)
    saved, loaded = _plain_state(base), _plain_state(again)
    equal = saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    more = run_example([*layout_args(*layout), *common, "--steps", "2"], nproc=procs)
    plain = run_example([*layout_args(1, 1, 1), *common, "--steps", "2"])
    diff = worst_relative(more["losses"], plain["losses"])
    record("checkpoint", {"saved": "(2, 2, 2)", "loaded": str(layout), "equal": equal, "loss_diff": diff})
    assert equal
    assert diff < TOLERANCE


@functools.cache
def _saved_222() -> Path:
    """A checkpoint of the example GPT saved at (2, 2, 2) with FSDP after 2 steps."""
    path = Path(tempfile.mkdtemp(prefix="tpcompile-hybrid-ckpt-")) / "ckpt"
    run_example(["--model", "gpt", *layout_args(2, 2, 2), "--layers", "4", "--inputs", "8x16:long", "--steps", "2",
                 "--json", "--save", str(path)], nproc=8)
    return path


@pytest.mark.parametrize("data_parallel", ["fsdp", "ddp"])
def test_meta_model_reads_its_slices_from_safetensors(data_parallel: str, tmp_path: Path) -> None:
    """A GPT built on meta at (2, 1, 2), weights from a .safetensors file without the tied alias: reference losses."""
    from safetensors.torch import save_file

    from tpcompile.runtime import launch
    state = {k: v.contiguous() for k, v in build("gpt").state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "w.safetensors"))
    ranks = launch(4, meta_rank, str(tmp_path / "w.safetensors"), data_parallel, timeout=600)
    want = tiny_reference("gpt", 3)["losses"]
    assert max(relative(a, b) for r in ranks for a, b in zip(r, want)) < 1e-9


USER_MODEL = "tests/user_lm.py:make"  # a factory with no example_inputs() and no seed of its own


@pytest.mark.parametrize("layout", [(1, 3, 1), (2, 3, 1)], ids=lambda t: "x".join(map(str, t)))
def test_three_tp_ranks_split_heads_they_do_not_divide(layout: tuple[int, int, int]) -> None:
    """hf:llama's 4 heads and 2 kv heads at tp 3: padded to 2 and 1 a rank; the reference losses, and each rank
    holds less than half of the model."""
    out = _train("hf:llama", layout, "ddp")
    assert max(out["param_bytes_per_rank"]) < 0.5 * out["model_param_bytes"]


@pytest.mark.parametrize("layout", [(2, 2, 2), (2, 4, 1), (1, 2, 4)], ids=lambda t: "x".join(map(str, t)))
def test_user_model_file_gives_the_reference_losses(layout: tuple[int, int, int]) -> None:
    """A user's model file under torchrun: each rank builds it after seed 0, losses equal the reference's."""
    args = ["--model", USER_MODEL, "--inputs", "4x16:long", "--steps", "3", "--json"]
    out = run_example([*layout_args(*layout), *args], nproc=math.prod(layout))
    ref = run_example(["--dp", "1", "--tp", "1", "--pp", "1", *args])
    record("user_model", {**out, "loss_diff": worst_relative(out["losses"], ref["losses"])})
    assert worst_relative(out["losses"], ref["losses"]) < TOLERANCE, (out["losses"], ref["losses"])


PRECISION_LAYOUTS = [(2, 2, 1), (1, 2, 2), (2, 1, 2)]
PRECISION_RTOL = 1e-2  # bf16 against the same policy in one process


@pytest.mark.parametrize("layout", PRECISION_LAYOUTS, ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("model", MODELS)
def test_bf16_mixed_precision_gives_the_reference_losses(model: str, layout: tuple[int, int, int]) -> None:
    """bf16 compute, float32 weights, state and reductions: 10 AdamW steps within 1e-2 of the policy in one process."""
    args = ["--model", model, "--layers", "4", "--inputs", "8x16:long", "--steps", "10", "--mixed-precision", "bf16",
            "--json"]
    out = run_example([*layout_args(*layout), *args], nproc=math.prod(layout))
    ref = run_example(["--dp", "1", "--tp", "1", "--pp", "1", *args])
    diff = worst_relative(out["losses"], ref["losses"])
    record("mixed_precision", {**out, "loss_diff": diff})
    assert diff < PRECISION_RTOL, (out["losses"], ref["losses"])


RESUME_LAYOUTS = [(2, 1, 2), (1, 1, 1)]
RESUME_RTOL = 1e-6  # float32: resumed at another layout against the uninterrupted run
DROPOUT = ["--config", "dropout=0.1"]


def _resume_args(dropout: bool) -> list[str]:
    """The GPT of the resume cases, with dropout on or off."""
    return ["--model", "gpt", "--layers", "4", "--inputs", "8x16:long", "--json", *(DROPOUT if dropout else [])]


@functools.cache
def _saved_121(dropout: bool) -> Path:
    """A directory holding the whole training state saved at (1, 2, 1) after 3 AdamW steps."""
    path = Path(tempfile.mkdtemp(prefix="tpcompile-resume-")) / "ckpt"
    run_example([*layout_args(1, 2, 1), *_resume_args(dropout), "--steps", "3", "--checkpoint-dir", str(path),
                 "--save-every", "3"], nproc=2)
    return path


@functools.cache
def _six_steps(dropout: bool) -> list[float]:
    """The uninterrupted 6 steps: the plain single process, or with dropout (tpcompile's masks) (1, 2, 1)."""
    if dropout:
        return run_example([*layout_args(1, 2, 1), *_resume_args(True), "--steps", "6"], nproc=2)["losses"]
    return run_example([*layout_args(1, 1, 1), *_resume_args(False), "--steps", "6"])["losses"]


@pytest.mark.parametrize("dropout", [False, True], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("layout", RESUME_LAYOUTS, ids=lambda t: "x".join(map(str, t)))
def test_training_state_saved_at_121_resumes_at(layout: tuple[int, int, int], dropout: bool, tmp_path: Path) -> None:
    """Saved at (1, 2, 1) after 3 steps (weights, AdamW, step, RNG), resumed at another layout for 3 more: the
    losses of 6 uninterrupted steps within 1e-6 (with dropout, (1, 1, 1) is one torchrun process: tpcompile's masks)."""
    import shutil
    ckpt = tmp_path / "ckpt"
    shutil.copytree(_saved_121(dropout), ckpt)
    procs = math.prod(layout) if layout != (1, 1, 1) or dropout else None
    out = run_example([*layout_args(*layout), *_resume_args(dropout), "--steps", "6", "--checkpoint-dir", str(ckpt)],
                      nproc=procs)
    want = _six_steps(dropout)
    diff = worst_relative(out["losses"], want[3:])
    record("resume", {"saved": "(1, 2, 1)", "loaded": str(layout), "dropout": dropout, "loss_diff": diff,
                      "start_step": out["start_step"]})
    assert out["start_step"] == 3
    assert diff < RESUME_RTOL, (out["losses"], want[3:])
