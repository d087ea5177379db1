"""The command line in-process: one-line user errors (exit 2), mismatches (exit 1), --debug, --plan, hf inputs."""
from __future__ import annotations

from pathlib import Path

import pytest

from tpcompile.cli import main
from tpcompile.errors import TPCompileError

GOLDEN = Path(__file__).parent / "golden"

MODELS = '''
import torch
from torch import nn


class Branchy(nn.Module):
    """Python control flow on a tensor's value: torch.export cannot capture it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.fc(x)
        return x

    def example_inputs(self) -> tuple:
        return (torch.ones(2, 4),)


class Noisy(nn.Module):
    """Adds fresh noise on every call, so the ranks cannot agree with the original."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return y + torch.randn_like(y)

    def example_inputs(self) -> tuple:
        return (torch.ones(2, 8),)


class NoExamples(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)
'''


@pytest.fixture
def models(tmp_path: Path) -> Path:
    """A model file with the awkward models."""
    path = tmp_path / "awkward.py"
    path.write_text(MODELS)
    return path


def _one_error_line(capsys: pytest.CaptureFixture[str], start: str) -> str:
    """The captured stderr, checked to be exactly one line starting with `start`; stdout empty."""
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1, err
    assert lines[0].startswith(start), lines[0]
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(("argv", "start"), [
    (["plan", "missing_file.py:Model"], "error: cannot resolve model 'missing_file.py:Model': file "),
    (["plan", "not-a-model"], "error: cannot resolve model 'not-a-model'; accepted forms: file.py:NAME"),
    (["diff", "tpcompile.models.mlp:Nope"], "error: cannot resolve model 'tpcompile.models.mlp:Nope'"),
    (["plan", "mlp", "-w", "0"], "tpcompile plan: error: argument -w/--world-size: must be at least 1, got 0"),
    (["verify", "mlp", "-w", "-2"], "tpcompile verify: error: argument -w/--world-size: must be at least 1"),
    (["dump", "mlp", "-w", "2.5"], "tpcompile dump: error: argument -w/--world-size: '2.5' is not an integer"),
    (["verify", "mlp", "--inputs", "4by64"], "error: --inputs '4by64' is not a valid input spec; expected SHAPE"),
    (["verify", "mlp", "--inputs", "4x64:complex"], "error: --inputs '4x64:complex': unknown dtype 'complex'"),
    (["plan", "gpt", "--config", "n_layers=1"], "error: gpt: unknown --config key 'n_layers'; known keys are"),
    (["diff", "mlp", "--rank", "2"], "error: --rank 2 is out of range for world size 2"),
    (["plan"], "tpcompile plan: error: the following arguments are required: MODEL"),
    ([], "tpcompile: error: the following arguments are required: COMMAND"),
])
def test_user_errors_are_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], start: str) -> None:
    """Each user error prints one line on stderr, nothing on stdout, and exits 2."""
    assert main(argv) == 2
    _one_error_line(capsys, start)


def test_untraceable_model(capsys: pytest.CaptureFixture[str], models: Path) -> None:
    """torch.export's failure (and the partial graph torch prints) becomes one line with the way out."""
    assert main(["plan", f"{models}:Branchy"]) == 2
    line = _one_error_line(capsys, "error: torch.export could not capture Branchy: ")
    assert "torch.cond for data-dependent Python control flow" in line


def test_debug_shows_the_exception(models: Path) -> None:
    """--debug lets the error propagate with its traceback."""
    with pytest.raises(TPCompileError, match="torch.export could not capture Branchy"):
        main(["plan", f"{models}:Branchy", "--debug"])


def test_verify_mismatch_exits_1(capsys: pytest.CaptureFixture[str], models: Path) -> None:
    """verify prints FAIL with the error per output and exits 1 when the ranks disagree with the original."""
    assert main(["verify", f"{models}:Noisy", "-w", "2"]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[1].startswith("output (2x8): max |diff| ")
    assert float(lines[1].split("max |diff| ")[1].split(",")[0]) > 0.1  # unit-variance noise, not rounding
    assert lines[-1].startswith("FAIL: max |diff| ") and "= atol 1e-05 + rtol 1.3e-06 x max |output| " in lines[-1]


@pytest.mark.parametrize("command", ["verify", "plan", "dump", "diff", "demo"])
def test_every_command_needs_inputs(capsys: pytest.CaptureFixture[str], models: Path, command: str) -> None:
    """A model without example_inputs() and no --inputs: one line saying what to pass, before any sharding."""
    assert main([command, f"{models}:NoExamples"]) == 2
    line = _one_error_line(capsys, f"error: {command} needs inputs and ")
    assert "NoExamples.forward(x: torch.Tensor)" in line
    assert "e.g. --inputs 2x8 (its first layer fc is a Linear of 8 inputs)" in line


def test_verify_needs_inputs(capsys: pytest.CaptureFixture[str], models: Path) -> None:
    """A model without example_inputs() asks for --inputs; with them, check (verify's alias) passes."""
    assert main(["verify", f"{models}:NoExamples"]) == 2
    _one_error_line(capsys, "error: verify needs inputs")
    assert main(["check", f"{models}:NoExamples", "--inputs", "3x8"]) == 0
    out = capsys.readouterr().out
    assert "output (3x8): max |diff| " in out and out.strip().splitlines()[-1].startswith("OK")


def test_diff_prints_the_golden_text(capsys: pytest.CaptureFixture[str]) -> None:
    """`tpcompile diff mlp -w 2` prints exactly the stored golden diff of the bundled MLP."""
    assert main(["diff", "mlp", "-w", "2"]) == 0
    assert capsys.readouterr().out == (GOLDEN / "mlp_ws2.diff").read_text(encoding="utf-8")


def test_dump_without_out_prints_code(capsys: pytest.CaptureFixture[str]) -> None:
    """dump without --out prints the chosen rank's code, which calls a tpcompile collective."""
    assert main(["dump", "mlp", "--rank", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# ---- rank 1 of 2 ----\n") and "# ---- rank 0" not in out
    assert "torch.ops.tpcompile.all_reduce.inplace" in out  # the default passes sum in place


def test_plan_file_flag(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """--plan FILE replicates the module it names (shown by plan, exact under verify); a bad file is one line."""
    good = tmp_path / "plan.yaml"
    good.write_text("transformer.h.0.mlp: replicate\n")
    assert main(["plan", "gpt", "--plan", str(good)]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert rows["transformer.h.0.mlp.c_fc.weight"][1] == "replicated"
    assert rows["transformer.h.1.mlp.c_fc.weight"][1] == "column@0"
    assert rows["transformer.h.0.mlp"][1:5] == ["replicated", "129.2", "KiB", "100%"]
    assert main(["verify", "gpt", "--plan", str(good)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("OK")
    bad = tmp_path / "bad.yaml"
    bad.write_text("transformer.h.0.mlp: replicate\ntransformer.h.1.mlp: halve\n")
    assert main(["plan", "gpt", "--plan", str(bad)]) == 2
    assert "line 2" in _one_error_line(capsys, "error: plan file ")


def test_verify_hf_model_at_new_shape(capsys: pytest.CaptureFixture[str]) -> None:
    """hf:gpt2 with --inputs 3x5:long: the ids go in as the first positional input; logits match at 2 ranks."""
    assert main(["verify", "hf:gpt2", "--inputs", "3x5:long", "--config", "n_layer=1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "(3x5 int64, use_cache=False, seed 1)" in lines[0]
    assert lines[1].startswith("logits (3x5x128): max |diff| ")
    assert lines[-1].startswith("OK")
