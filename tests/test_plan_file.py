"""YAML plan files: safe parsing, schema errors naming the key and line, and use as shard(plan=...)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tpcompile
from tpcompile.models import build
from tpcompile.overrides import load_overrides as load_plan
from tpcompile.overrides import parse_overrides as parse_plan


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    return path


def test_load_plan_reads_entries_and_lines(tmp_path: Path) -> None:
    """A valid file gives a dict of module path -> value, with each key's line remembered."""
    plan = load_plan(_write(tmp_path, "# replicate the first block\ntransformer.h.0: replicate\nlm_head: sharded_output\n"))
    assert plan == {"transformer.h.0": "replicate", "lm_head": "sharded_output"}
    assert plan.lines == {"transformer.h.0": 2, "lm_head": 3}


def test_empty_file_is_an_empty_plan(tmp_path: Path) -> None:
    """An empty (or comments-only) file is the automatic plan."""
    assert load_plan(_write(tmp_path, "# nothing\n")) == {}


def test_shard_accepts_a_plan_file_path(tmp_path: Path) -> None:
    """shard(plan=path) applies the file, and the ranks still equal the original model."""
    torch.manual_seed(0)
    model = build("gpt").eval()
    path = _write(tmp_path, "transformer.h.0.attn: replicate\n")
    sm = tpcompile.shard(model, 2, plan=str(path))
    assert sm.plan.modules["transformer.h.0.attn.c_attn"] == "replicated"
    assert sm.plan.modules["transformer.h.1.attn.c_attn"] == "column"
    sm_path = tpcompile.shard(model, 2, plan=path)  # a Path works too
    assert sm_path.plan.modules == sm.plan.modules
    idx = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        ref = model(idx)
        for out in tpcompile.simulate(sm, idx):
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_unknown_module_names_file_and_line(tmp_path: Path) -> None:
    """A key the model lacks is reported with the file, its line and close matches."""
    path = _write(tmp_path, "lm_head: auto\ntransformer.h.0.atn: replicate\n")
    with pytest.raises(tpcompile.TPCompileError, match=rf"plan names module 'transformer\.h\.0\.atn' \({path} line 2\), "
                                                      rf"which the model does not have; did you mean transformer\.h\.0\.attn"):
        tpcompile.shard(build("gpt"), 2, plan=path)


@pytest.mark.parametrize("text, message", [
    ("lm_head: rowwise\n", r"line 1: lm_head: 'rowwise' is not a plan value; use one of auto, replicate, sharded_output"),
    ("lm_head: replicate\nfoo: 3\n", r"line 2: foo: 3 \(int\) is not a plan value"),
    ("lm_head:\n  - replicate\n", r"line 2: lm_head: a list is not a plan value"),
    ("lm_head: true\n", r"line 1: lm_head: true \(bool\) is not a plan value"),
    ("a: auto\nb b: replicate\n", r"line 2: key 'b b' is not a module path"),
    ("[1, 2]: auto\n", r"line 1: key a list is not a module path"),
    ("lm_head: auto\nlm_head: replicate\n", r"line 2: key 'lm_head' repeats line 1"),
    ("- lm_head\n", r"line 1: the top level is a list, not a mapping"),
    ("replicate\n", r"line 1: the top level is a single value, not a mapping"),
    ("lm_head: !!python/object/apply:os.system ['true']\n", r"line 1: lm_head: .*is not a plan value"),
])
def test_bad_values_and_keys(tmp_path: Path, text: str, message: str) -> None:
    """Each schema violation names the file, the line and the key or value, and what is accepted."""
    path = _write(tmp_path, text)
    with pytest.raises(tpcompile.TPCompileError, match=rf"plan file {path} {message}"):
        load_plan(path)


@pytest.mark.parametrize("text, line", [
    ("lm_head: replicate\ntransformer.h.0: [auto\n", 3),
    ("lm_head: replicate\n  bad indent: auto\n", 2),
    ("a: 'unterminated\n", 2),
])
def test_yaml_syntax_error_names_the_line(tmp_path: Path, text: str, line: int) -> None:
    """A YAML syntax error is a TPCompileError with the file, line and column."""
    path = _write(tmp_path, text)
    with pytest.raises(tpcompile.TPCompileError, match=rf"plan file {path}: YAML syntax error at line {line}, column \d+: "):
        load_plan(path)


def test_missing_file(tmp_path: Path) -> None:
    """A path that is not a file says so and what to pass."""
    with pytest.raises(tpcompile.TPCompileError, match=r"plan file '.*nope\.yaml' does not exist .*transformer\.h\.0\.attn: replicate"):
        tpcompile.shard(build("mlp"), 2, plan=tmp_path / "nope.yaml")


def test_numeric_module_names_are_paths() -> None:
    """nn.Sequential's children are called '0', '1': a bare 0 key is a module path, not a number."""
    assert parse_plan("0: replicate\n1.fc: auto\n") == {"0": "replicate", "1.fc": "auto"}


def test_plan_of_wrong_type() -> None:
    """A plan that is neither a dict nor a path names its type and both accepted forms."""
    with pytest.raises(tpcompile.TPCompileError, match=r"plan must be a dict .* or the path of a YAML plan file; got list"):
        tpcompile.shard(build("mlp"), 2, plan=["lm_head"])
