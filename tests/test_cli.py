"""The tpcompile command, run as a new user would: a model file written here, each subcommand a subprocess."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

import tpcompile
from tpcompile.models.spec import load_model

# A vocabulary embedding, an FFN with a residual and a head: vocab, column and row splits and a gather.
TINY = '''
import torch
import torch.nn.functional as F
from torch import nn


class Tiny(nn.Module):
    def __init__(self, vocab: int = 32, width: int = 16, hidden: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + self.down(F.gelu(self.up(h)))
        return self.head(h)

    def example_inputs(self) -> tuple:
        return (torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(0)),)

'''


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The user's model file."""
    path = tmp_path_factory.mktemp("user") / "tiny.py"
    path.write_text(TINY)
    return path


def tpc(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run `python -m tpcompile ARGS` as a separate process, output piped."""
    # one intra-op thread, like the in-process tests: the suite's processes share a small machine
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "tpcompile", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=240, env=env)


def _sharded(model_file: Path, world_size: int = 2, **config: object) -> tuple:
    """The same model sharded through the Python API, for comparison with what the command printed."""
    model, args, kwargs = load_model(f"{model_file}:Tiny", config)
    return model, args, tpcompile.shard(model, world_size, example_inputs=args)


def test_plan(model_file: Path) -> None:
    """plan: every parameter's split and per-rank bytes, per-block rows, collectives counted at the --inputs shape."""
    proc = tpc("plan", "tiny.py:Tiny", "-w", "2", "--inputs", "3x7:long", "--config", "hidden=32",
               cwd=model_file.parent)
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.strip()}
    # hidden=32 from --config: up is 32x16, each rank 16x16 float32 = 1 KiB
    assert rows["up.weight"] == ["up.weight", "column@0", "32x16", "16x16", "1.0", "KiB"]
    assert rows["down.weight"][1:4] == ["row@1", "16x32", "16x16"]
    assert rows["emb.weight"][1:4] == ["vocab@0", "32x16", "16x16"]
    assert rows["down.bias"][1] == "replicated"
    # block rows: each top-level module is its own block, with the collectives its nodes issue
    assert rows["down"][1:5] == ["down", "row", "1.1", "KiB"] and rows["down"][-2:] == ["1", "all_reduce"]
    assert rows["emb"][1:3] == ["emb", "vocab"] and rows["emb"][-2:] == ["1", "all_reduce"]
    # collectives come from the simulated forward at 3x7: two all-reduces of 3*7*16 float32 = 1344 B each
    assert rows["all_reduce"][1:5] == ["2", "3x7x16", "2.6", "KiB"]
    assert rows["all_gather_replicated"][1:3] == ["1", "3x7x16"]
    assert "communication per forward per rank: 3 collectives" in proc.stdout
    assert "(inputs 3x7 int64)" in proc.stdout
    assert not any(line != line.rstrip() for line in proc.stdout.splitlines()), "no trailing blanks in a pipe"
    # numerical twin: the plan the table shows computes the original model's output
    model, args, sm = _sharded(model_file, hidden=32)
    assert [tuple(sm.plan.parameters[n].local_shape) for n in ("up.weight", "down.weight")] == [(16, 16), (16, 16)]
    with torch.no_grad():
        torch.testing.assert_close(tpcompile.simulate(sm, *args)[1], model(*args), atol=1e-5, rtol=0)


def test_dump(model_file: Path, tmp_path: Path) -> None:
    """dump --out: original/ and rank<R>/ each with code.py, nodes.txt, graph.svg and graph.dot."""
    out = tmp_path / "dump"
    proc = tpc("dump", f"{model_file}:Tiny", "-w", "2", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    files = {"code.py", "nodes.txt", "graph.svg", "graph.dot"}
    for folder in ("original", "rank0", "rank1"):
        assert {p.name for p in (out / folder).iterdir()} == files, folder
    model, args, sm = _sharded(model_file)
    assert (out / "rank1" / "code.py").read_text() == sm.rank(1).code.strip() + "\n"
    assert (out / "original" / "code.py").read_text() == sm.captured.code.strip() + "\n"
    nodes = (out / "rank0" / "nodes.txt").read_text().splitlines()
    table = {line.split()[0]: line.split() for line in nodes[3:]}
    assert table["all_reduce_default_1"][1:3] == ["call_function", "tpcompile.all_reduce.inplace"]  # comm=None
    assert table["all_reduce_default_1"][-3:] == ["2x5x16", "float32", "down"]  # shape from the traced forward
    assert table["up_weight"][-3:] == ["32x16", "float32", "up"]  # the rank's slice, not the whole weight
    assert table["linear"][3] == "S(2)"  # the column split's output placement
    svg = ET.parse(out / "rank0" / "graph.svg").getroot()
    ns = "{http://www.w3.org/2000/svg}"
    hexagons = [p for p in svg.iter(f"{ns}polygon")]
    collectives = [n for n in sm.rank(0).graph.nodes if getattr(n.target, "namespace", None) == "tpcompile"]
    assert len(hexagons) == len(collectives) == 5
    assert len(list(svg.iter(f"{ns}rect"))) > len(list(sm.rank(0).graph.nodes)) - len(collectives)
    dot = (out / "original" / "graph.dot").read_text()
    assert dot.startswith("digraph") and '"emb_weight" -> "embedding"' in dot
    with torch.no_grad():  # numerical twin: the dumped graphs compute the original output
        for o in tpcompile.simulate(sm, *args):
            torch.testing.assert_close(o, model(*args), atol=1e-5, rtol=0)


def test_diff(model_file: Path) -> None:
    """diff --rank 1: collectives added, parameters sliced (old -> new), nodes removed, then the code diff."""
    proc = tpc("diff", "tiny.py:Tiny", "--rank", "1", cwd=model_file.parent)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("# Tiny (tiny.py:Tiny): captured graph -> rank 1 of 2\n")
    section = lambda name: out.split(f"## {name}: ")[1].split("\n## ")[0]  # noqa: E731
    assert section("collectives added").startswith("5\n")
    assert "all_reduce(linear_default, 'default')" in section("collectives added")
    sliced = section("parameters sliced (old shape -> new shape)").splitlines()
    assert sliced[0] == "5"
    assert "  down.weight  [16, 64] -> [16, 32]  row@1" in sliced
    assert section("nodes removed").splitlines()[1:] == ["  embedding  aten.embedding.default  emb",
                                                         "  linear_1   aten.linear.default     down"]
    code = out.split("## code (unified diff, captured -> rank 1)\n")[1]
    assert code.startswith("--- captured\n+++ rank1\n")
    # rank 1 looks up the upper half of the vocabulary
    # (the ids, or the ids once checked)
    assert re.search(r"^\+    lt_scalar = torch\.ops\.aten\.lt\.Scalar\(\w+, 16\)$", code, re.M)
    model, args, sm = _sharded(model_file)
    with torch.no_grad():
        torch.testing.assert_close(tpcompile.simulate(sm, *args)[1], model(*args), atol=1e-5, rtol=0)


def test_verify(model_file: Path) -> None:
    """verify at --inputs 4x9:long: the max error per output and OK, exit 0."""
    proc = tpc("verify", "tiny.py:Tiny", "-w", "4", "--inputs", "4x9:long", cwd=model_file.parent)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == "verify Tiny (tiny.py:Tiny) at world size 4 on random inputs (4x9 int64, seed 1)"
    assert lines[1].startswith("output (4x9x32): max |diff| ") and "rank 3 " in lines[1]
    worst = float(lines[1].split("max |diff| ")[1].split(",")[0])
    assert worst <= 1e-5
    assert lines[-1].startswith("OK: max |diff| ")


@pytest.mark.gloo
def test_demo(model_file: Path) -> None:
    """demo MODEL --inputs: every rank runs as a real gloo process on those inputs and matches the unsharded model."""
    proc = tpc("demo", "tiny.py:Tiny", "-w", "2", "--repeats", "1", "--inputs", "3x7:long", cwd=model_file.parent)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "launching 2 gloo processes..." in out
    assert "rank 0: forward" in out and "rank 1: forward" in out
    # at the --inputs shape each collective takes 3*7*16 float32 = 1344 B: 3 of them 3.9 KiB (at 2x5, 1.9 KiB)
    assert "3.9 KiB moved: all_reduce (forward) x2, all_gather_replicated (forward) x1" in out
    assert out.strip().splitlines()[-1].startswith("OK: all 2 ranks match the unsharded model: max |diff| ")


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    """--version prints the package's version and torch's, exit 0."""
    from tpcompile.cli import main

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"tpcompile {tpcompile.__version__} (torch {torch.__version__})\n"


def test_a_model_without_inputs_stops_before_any_work(tmp_path: Path) -> None:
    """demo of a model with no example_inputs() and no --inputs: one line saying what to pass, nothing printed."""
    (tmp_path / "bare.py").write_text("from torch import nn\n\n\nclass Bare(nn.Module):\n    def __init__(self):\n"
                                      "        super().__init__()\n        self.fc = nn.Linear(8, 8)\n\n"
                                      "    def forward(self, x):\n        return self.fc(x)\n")
    proc = tpc("demo", "bare.py:Bare", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == ("error: demo needs inputs and bare.py:Bare has no example_inputs(); pass --inputs "
                                   "SHAPE[:DTYPE] once per positional argument of Bare.forward(x), e.g. --inputs "
                                   "2x8 (its first layer fc is a Linear of 8 inputs), or give the model an "
                                   "example_inputs() method")


def test_user_errors_name_the_users_terms(model_file: Path) -> None:
    """A NAME the file lacks names the file and what it defines; ids beyond the vocabulary are the user's error."""
    proc = tpc("verify", "tiny.py:Tin", "--inputs", "2x16:long:100000", cwd=model_file.parent)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: cannot resolve model 'tiny.py:Tin': tiny.py has no 'Tin'; did you mean "
                                   "Tiny? it defines: Tiny")
    from tpcompile.cli import main

    assert main(["verify", f"{model_file}:Tiny", "--inputs", "2x16:long:100000"]) == 2  # exit 2, not a crash


def test_a_folder_named_tpcompile_is_named(tmp_path: Path) -> None:
    """Run next to a folder called tpcompile (the clone), the command says that folder shadows the package."""
    (tmp_path / "tpcompile").mkdir()
    proc = tpc("plan", "mlp", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith(f"error: `import tpcompile` found the folder {tmp_path / 'tpcompile'} ")
    assert "run from another folder" in proc.stderr and "Traceback" not in proc.stderr
