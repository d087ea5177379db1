"""The tpcompile command line, run in-process through main()."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tpcompile
from tpcompile import cli
from tpcompile.cli import main, max_abs_diff
from tpcompile.models import build


@pytest.fixture(scope="module")
def mlp_sharded() -> object:
    """The bundled MLP sharded over 2 ranks through the Python API, for comparison with the CLI."""
    model = build("mlp")
    return tpcompile.shard(model, 2, example_inputs=model.example_inputs())


def test_plan_prints_the_api_summary(capsys: pytest.CaptureFixture[str], mlp_sharded: object) -> None:
    """`plan mlp -w 2` exits 0 and prints exactly what ShardedModel.summary() returns."""
    assert main(["plan", "mlp", "-w", "2"]) == 0
    out = capsys.readouterr().out
    assert mlp_sharded.summary().strip() in out


def test_dump_prints_every_rank(capsys: pytest.CaptureFixture[str], mlp_sharded: object) -> None:
    """`dump` prints each rank's generated code, and the code calls a tpcompile collective."""
    assert main(["dump", "mlp", "-w", "2"]) == 0
    out = capsys.readouterr().out
    for r in range(2):
        assert f"# ---- rank {r} of 2 ----" in out
        assert mlp_sharded.rank(r).code.strip() in out
    assert "tpcompile" in mlp_sharded.rank(0).code


def test_dump_writes_one_file_per_rank(tmp_path: Path, mlp_sharded: object) -> None:
    """`dump --out DIR` writes rank<R>.py holding that rank's code."""
    assert main(["dump", "mlp", "-w", "2", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.py", "rank1.py"]
    assert (tmp_path / "rank1.py").read_text() == mlp_sharded.rank(1).code


def test_dump_single_rank(capsys: pytest.CaptureFixture[str]) -> None:
    """`dump --rank 1` prints rank 1 only."""
    assert main(["dump", "mlp", "-w", "2", "--rank", "1"]) == 0
    out = capsys.readouterr().out
    assert "# ---- rank 1 of 2 ----" in out and "# ---- rank 0" not in out


def test_diff_shows_inserted_collectives(capsys: pytest.CaptureFixture[str]) -> None:
    """`diff` prints a unified diff from the captured graph whose added lines include a collective."""
    assert main(["diff", "mlp", "-w", "2", "--rank", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("--- captured\n+++ rank1\n")
    added = [line for line in out.splitlines() if line.startswith("+") and not line.startswith("+++")]
    assert any("tpcompile" in line for line in added)


@pytest.mark.parametrize("spec", ["mlp", "gpt", "hf:gpt2"])
def test_check_passes(capsys: pytest.CaptureFixture[str], spec: str) -> None:
    """`check` simulates all ranks, prints a per-rank difference and exits 0 when they match."""
    assert main(["check", spec, "-w", "2"]) == 0
    out = capsys.readouterr().out
    assert "rank 0: max |diff|" in out and "rank 1: max |diff|" in out
    assert out.strip().splitlines()[-1].startswith("OK")


def test_plan_from_model_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`plan file.py:NAME` shards a model defined in a user's file and names its weights."""
    path = tmp_path / "ffn.py"
    path.write_text(
        "import torch\n"
        "from torch import nn\n\n"
        "class FFN(nn.Module):\n"
        "    def __init__(self) -> None:\n"
        "        super().__init__()\n"
        "        self.up = nn.Linear(16, 64)\n"
        "        self.down = nn.Linear(64, 16)\n\n"
        "    def forward(self, x: torch.Tensor) -> torch.Tensor:\n"
        "        return self.down(torch.relu(self.up(x)))\n\n"
        "    def example_inputs(self) -> tuple:\n"
        "        return (torch.randn(3, 16),)\n"
    )
    assert main(["plan", f"{path}:FFN", "-w", "2"]) == 0
    out = capsys.readouterr().out
    assert "up.weight" in out and "down.weight" in out


def test_check_fails_on_mismatch(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """`check` exits 1 and says FAIL when a rank's output is off by more than the tolerance."""
    real = tpcompile.simulate

    def perturbed(sharded: object, *args: object, **kwargs: object) -> list:
        """Run the real simulator, then shift rank 1's output."""
        outs = real(sharded, *args, **kwargs)
        outs[1] = outs[1] + 1e-3
        return outs

    monkeypatch.setattr(cli.tpcompile, "simulate", perturbed)
    assert main(["check", "mlp", "-w", "2"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_unknown_model_is_error_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    """A bad MODEL prints `error: ...` on stderr, no traceback, and exits 2."""
    assert main(["plan", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "error: cannot resolve model 'no-such-model'" in err
    assert "Traceback" not in err


def test_rank_out_of_range_is_error_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    """`--rank` beyond the world size is a user error with exit code 2."""
    assert main(["dump", "mlp", "-w", "2", "--rank", "2"]) == 2
    assert "error: --rank 2 is out of range" in capsys.readouterr().err


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    """A missing subcommand, a missing MODEL or a zero world size is a usage error with exit 2."""
    assert main([]) == 2
    assert main(["plan"]) == 2
    assert main(["plan", "mlp", "-w", "0"]) == 2
    assert "usage:" in capsys.readouterr().err


def test_max_abs_diff_walks_structures() -> None:
    """max_abs_diff compares every tensor in nested outputs and is infinite on a shape mismatch."""
    a = {"x": torch.zeros(2), "y": (torch.ones(3),)}
    b = {"x": torch.zeros(2), "y": (torch.ones(3) + 0.5,)}
    assert max_abs_diff(a, b) == pytest.approx(0.5)
    assert max_abs_diff(torch.zeros(2), torch.zeros(3)) == float("inf")


def test_python_dash_m(tmp_path: Path) -> None:
    """`python -m tpcompile plan mlp` runs as a program and exits 0."""
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "tpcompile", "plan", "mlp"], cwd=repo,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()


@pytest.mark.gloo
def test_demo_end_to_end(capsys: pytest.CaptureFixture[str]) -> None:
    """`demo` shards the bundled GPT, runs 2 real gloo processes and every rank matches the original."""
    assert main(["demo", "--world-size", "2", "--repeats", "3"]) == 0
    out = capsys.readouterr().out
    assert "launching 2 gloo processes..." in out
    assert "rank 0: forward" in out and "rank 1: forward" in out
    assert "collectives: 0," not in out
    assert out.strip().splitlines()[-1].startswith("OK: all 2 ranks match")
