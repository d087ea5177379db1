"""A newcomer's afternoon (issue 32): --config under a model's own key names, inputs of the wrong dtype, models'
own example inputs, errors that point the right way, progress in a pipe, one-line errors from the examples."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import tpcompile
from tpcompile.cli import main
from tpcompile.cli import progress
from tpcompile.errors import TPCompileError, TPCompileWarning
from tpcompile.models import build

ROOT = Path(__file__).resolve().parents[1]

MODELS = '''
import torch
from torch import nn


class TinyLM(nn.Module):
    """A position table held by the root module itself, ahead of its embedding; its own example inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(16, 32))
        self.emb = nn.Embedding(64, 32)
        self.head = nn.Linear(32, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids) + self.pos[: ids.shape[1]])

    def example_inputs(self) -> tuple:
        return (torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0)),)


class Bare(TinyLM):
    """TinyLM without example inputs."""

    example_inputs = None


class NeedsArgs(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class Typo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + undefined_name  # noqa: F821

    def example_inputs(self) -> tuple:
        return (torch.randn(2, 8),)


class ReadsValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = int(x.sum() > 0) + 1
        return self.fc(x)[:, :keep]

    def example_inputs(self) -> tuple:
        return (torch.randn(2, 8),)


number = 3
'''


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model file, in its own folder."""
    path = tmp_path_factory.mktemp("newcomer") / "newcomer.py"
    path.write_text(MODELS)
    return path


def _error(capsys: pytest.CaptureFixture[str]) -> str:
    """The one error line on stderr (stdout empty)."""
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_config_keys_under_the_models_own_names() -> None:
    """--config n_layer=1 for gpt2 (and bloom) replaces the small default depth instead of losing to it."""
    from transformers import AutoConfig

    from tpcompile.models.hf import hf_config, hf_config_kwargs

    gpt2 = AutoConfig.for_model("gpt2")
    kwargs = hf_config_kwargs("hf:gpt2", "gpt2", gpt2, {"n_layer": 1, "n_embd": 32, "n_positions": 16})
    assert "num_hidden_layers" not in kwargs and "hidden_size" not in kwargs and "max_position_embeddings" not in kwargs
    config = hf_config("hf:gpt2", "gpt2", {"n_layer": 1, "n_embd": 32, "n_positions": 16})
    assert (config.n_layer, config.n_embd, config.n_positions, config.n_head) == (1, 32, 16, 4)
    assert hf_config("hf:bloom", "bloom", {"n_layer": 1}).n_layer == 1
    assert hf_config("hf:gpt2", "gpt2", {"num_hidden_layers": 3}).n_layer == 3
    with pytest.raises(TPCompileError, match="n_layer=1 and num_hidden_layers=3 set the same gpt2 config field"):
        hf_config("hf:gpt2", "gpt2", {"n_layer": 1, "num_hidden_layers": 3})
    # a rotary width sized for the default head dim shrinks with it: gptj and codegen build and run
    assert hf_config("hf:gptj", "gptj", {}).rotary_dim == 16


def test_integer_inputs_to_a_float_model(capsys: pytest.CaptureFixture[str]) -> None:
    """verify mlp --inputs 4x64:long says the dtype to write, in one line, without a fixed-dim warning first."""
    assert main(["verify", "mlp", "--inputs", "4x64:long"]) == 2
    line = _error(capsys)
    assert "MLPStack takes float32 values in input 'x', which is int64" in line and "linear at layers.0" in line
    assert line.endswith("write --inputs 4x64 for input 1") and "RuntimeError" not in line


def test_float_ids_to_a_token_model() -> None:
    """Float ids are refused at capture naming the embedding, and at run time by dtype, not as 'token id -1'."""
    model = build("gpt")
    with pytest.raises(TPCompileError, match=r"takes integer token ids in input 'idx', which is float32: the "
                                             r"embedding transformer\.wte \(256 rows\).*pass ids 0\.\.255"):
        tpcompile.shard(model, 2, example_inputs=(torch.randn(2, 16),))
    sm = tpcompile.shard(model, 2)
    with pytest.raises(TPCompileError, match="token ids at .* are float32; the model takes integer ids 0..255"):
        tpcompile.simulate(sm, torch.randn(2, 16))
    with pytest.raises(TPCompileError, match=r"token id 300 .* pass ids 0\.\.255$"):
        tpcompile.simulate(sm, torch.full((2, 16), 300))
    (idx,) = model.example_inputs()
    with torch.no_grad():  # numerical twin: long ids still give the original's output
        for out in tpcompile.simulate(sm, idx):
            torch.testing.assert_close(out, model(idx), atol=1e-5, rtol=1.3e-6)


def test_shard_and_plan_parallel_use_the_models_own_example_inputs(models: Path) -> None:
    """tpcompile.shard(model, 2) captures with example_inputs(); without them the refusal names the root's own
    parameter and the function that was called."""
    from tpcompile.models.spec import load_model

    model, _, _ = load_model(f"{models}:TinyLM")
    sm = tpcompile.shard(model, 2)
    (ids,) = model.example_inputs()
    with torch.no_grad():
        for out in tpcompile.simulate(sm, ids):
            torch.testing.assert_close(out, model(ids), atol=1e-5, rtol=1.3e-6)
    bare, _, _ = load_model(f"{models}:Bare")
    with pytest.raises(TPCompileError, match=r"it holds the parameter pos itself, before any Linear or Embedding; "
                                             r"pass example_inputs=.* to tpcompile\.shard"):
        tpcompile.shard(bare, 2)
    with pytest.raises(TPCompileError, match=r"to tpcompile\.plan_parallel"):
        tpcompile.plan_parallel(bare, {"gpus": 2, "gpus_per_node": 2}, global_batch=4, seq_len=None)


def test_encoder_decoder_inferred_inputs_leave_the_cache_out() -> None:
    """An encoder-decoder's inferred inputs pass use_cache=False, as a decoder's do (its cache is no export output)."""
    from transformers import T5Config, T5Model

    from tpcompile.capture import infer_example_inputs

    config = T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8, vocab_size=32)
    _, kwargs = infer_example_inputs(T5Model(config).eval())
    assert kwargs["use_cache"] is False and "input_ids" in kwargs


@pytest.mark.parametrize("spec, says", [
    ("newcomer.py:NeedsArgs", "missing 1 required positional argument: 'width'; pass it with --config width=VALUE"),
    ("newcomer.py:number", "it names an int, not an nn.Module"),
    ("newcomer.py", "name the model in the file as newcomer.py:NAME; it defines: Bare, NeedsArgs, ReadsValue, "
                    "TinyLM, Typo"),
    ("hf:notamodel", "no model type 'notamodel'; the model types are the keys"),
    ("hf:lama", "did you mean llama, mllama, llama4?"),
])
def test_model_strings_point_the_way(capsys: pytest.CaptureFixture[str], models: Path, monkeypatch: pytest.MonkeyPatch,
                                     spec: str, says: str) -> None:
    """A MODEL that does not resolve says what it found and what to write."""
    monkeypatch.chdir(models.parent)
    assert main(["plan", spec]) == 2
    line = _error(capsys)
    assert says in line and "Evolla" not in line


def test_a_bug_in_forward_is_not_an_inputs_problem(capsys: pytest.CaptureFixture[str], models: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A NameError in the user's forward names their file and line and asks to fix the code, not to pass --inputs."""
    monkeypatch.chdir(models.parent)
    assert main(["plan", "newcomer.py:Typo"]) == 2
    line = _error(capsys)
    assert "NameError: name 'undefined_name' is not defined (at newcomer.py:" in line
    assert line.endswith("the error is in the model's code, whatever its inputs: fix it there")
    assert "--inputs" not in line


def test_a_data_dependent_value_is_not_a_size(capsys: pytest.CaptureFixture[str], models: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture failure on a value read from a tensor says so and names the user's line."""
    monkeypatch.chdir(models.parent)
    assert main(["plan", "newcomer.py:ReadsValue"]) == 2
    line = _error(capsys)
    assert "a data-dependent value" in line and "a dynamic size" not in line
    assert "(at newcomer.py:" in line and "keep = int(x.sum() > 0) + 1" in line


@pytest.mark.parametrize("argv, says", [
    (["demo", "mlp", "--backend", "nccl"], "--backend nccl"),
    (["demo", "mlp", "--backend", "foo"], "invalid choice: 'foo'"),
    (["verify", "mlp", "--atol", "-1"], "--atol: must be a finite number of at least 0, got -1"),
    (["strategy", "gpt", "--gpus", "8", "--gpu-memory", "80", "--global-batch", "8"],
     "--gpu-memory: '80' reads as 80 bytes, far too little for a GPU; write the unit, like '80GB'"),
    (["generate", "gpt", "--prompt-len", "60", "--max-new-tokens", "10"],
     "--prompt-len + --max-new-tokens = 70 is longer than GPT's position table transformer.wpe (64 positions); "
     "make --prompt-len + --max-new-tokens at most 64"),
])
def test_flags_are_checked_in_their_own_terms(capsys: pytest.CaptureFixture[str], argv: list[str], says: str) -> None:
    """A bad flag is one line that names the flag (not a traceback, not a Python argument), exit 2."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0] and "Traceback" not in err[0] and "max_seq_len" not in err[0], err


def test_counts_agree_with_their_nouns() -> None:
    """demo's header says '1 thread' and '1 run', plurals from 2 on."""
    from tpcompile.cli.demo import results_header

    assert results_header(1, 1) == "per-rank results (1 thread per process, median of 1 run):"
    assert results_header(2, 10) == "per-rank results (2 threads per process, median of 10 runs):"


def test_warnings_for_fixed_sizes_say_whose_size_it_is() -> None:
    """A size the model's code fixes is not met with 'an example of size 2 or more', a size of 1 still is."""
    from tpcompile.capture.input_dims import warn_fixed
    from tpcompile.ops.guards import FixedDim

    args = (torch.zeros(2, 8, dtype=torch.long),)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TPCompileWarning)
        warn_fixed((FixedDim("ids", 0, 1, 8, "the model's code needs this exact size"),), args, {}, build("mlp"))
        warn_fixed((FixedDim("ids", 0, 0, 1, "the example has size 1 there"),), (torch.zeros(1, 8),), {},
                   build("mlp"))
    code, one = (str(w.message) for w in caught)
    assert "size 2 or more" not in code and "change the code that needs it" in code
    assert "capture and shard the model again for each other size" in code
    assert "size 2 or more" in one


def test_generation_splits_uneven_heads_and_pads_like_hf(capsys: pytest.CaptureFixture[str]) -> None:
    """generate -w 3 on 4 heads splits the cache (heads padded to 6, 2 a rank: half the cache on a rank) and
    warns nothing; shard_generation pads finished rows with pad_token_id."""
    assert main(["generate", "gpt", "-w", "3", "--prompt-len", "4", "--max-new-tokens", "2"]) == 0
    out, err = capsys.readouterr()
    assert "warning" not in err
    assert "cache per rank 3.0 KiB of 6.0 KiB unsharded\n" in out and "OK: all 3 ranks generated" in out
    gen = tpcompile.shard_generation(build("gpt"), 1, max_seq_len=12, max_batch_size=2)

    def run(ids: torch.Tensor, **kw: object) -> torch.Tensor:
        """Rank 0's tokens, run in the simulator."""
        return tpcompile.simulate_ranks(1, lambda r: gen.rank(r).generate(ids, **kw))[0]

    ids = torch.tensor([[5, 6, 7, 8]])
    first = int(run(ids, max_new_tokens=1)[0, -1])
    assert run(ids, max_new_tokens=4, eos_token_id=first, pad_token_id=3)[0, 4:].tolist() == [first]
    two = torch.tensor([[5, 6, 7, 8], [9, 9, 9, 9]])
    rows = run(two, max_new_tokens=3, eos_token_id=first, pad_token_id=3)
    assert rows.shape[1] > 5 and rows[1, 4] != first  # row 1 went on after row 0 ended
    assert rows[0, 4:].tolist() == [first] + [3] * (rows.shape[1] - 5)


def test_progress_in_a_pipe(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """With stderr not a terminal, a long step says so in plain lines on stderr; stdout stays the tables."""
    monkeypatch.setenv("TPCOMPILE_PROGRESS", "1")
    monkeypatch.setattr(progress, "PLAIN_AFTER_S", 0.0, raising=False)
    assert main(["plan", "mlp"]) == 0
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert "tpcompile: capturing MLPStack (mlp) and sharding it across 2 ranks ..." in lines
    assert any(ln.startswith("tpcompile: capturing MLPStack (mlp) and sharding it across 2 ranks: done in ") for ln in lines)
    assert out.startswith("tpcompile plan: MLPStack (mlp) at world size 2") and "tpcompile: " not in out
    monkeypatch.setenv("TPCOMPILE_PROGRESS", "0")
    assert main(["plan", "mlp"]) == 0
    assert "tpcompile: " not in capsys.readouterr().err


def test_script_errors_are_one_line_from_rank_0(capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """An example's TPCompileError is one line from rank 0 and exit 2; other ranks exit 2 silently."""
    from tpcompile.cli.script import run_script

    def fail() -> None:
        raise TPCompileError("needs dp*tp*pp = 4 processes")

    monkeypatch.setenv("RANK", "1")
    assert run_script(fail) == 2 and capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert run_script(fail) == 2 and capsys.readouterr().err == "error: needs dp*tp*pp = 4 processes\n"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "generate.py"), "--model", "nosuch.py:X"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "error: cannot resolve model 'nosuch.py:X': file 'nosuch.py' does not exist"], done.stderr
