"""Bad input gets a TPCompileError that names the value and the way out."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

import tpcompile
from tpcompile.models import build


@pytest.mark.parametrize("ws", [0, -2, 1.5, "2", True, None])
def test_bad_world_size(ws: object) -> None:
    """world_size must be an int >= 1; the message repeats the value given."""
    with pytest.raises(tpcompile.TPCompileError, match=r"world_size must be an int >= 1, got " + repr(ws).replace(".", r"\.")):
        tpcompile.shard(build("mlp"), ws)


def test_error_is_a_value_error() -> None:
    """TPCompileError is a ValueError, so generic handlers catch it."""
    assert issubclass(tpcompile.TPCompileError, ValueError)


def test_plan_naming_missing_module() -> None:
    """A plan key that is no module of the model is named, with close matches suggested."""
    with pytest.raises(tpcompile.TPCompileError, match=r"'transformer\.h\.0\.atn'.*did you mean transformer\.h\.0\.attn"):
        tpcompile.shard(build("gpt"), 2, plan={"transformer.h.0.atn": "replicate"})


def test_plan_with_unknown_value() -> None:
    """A plan value outside the accepted ones is rejected, listing them."""
    with pytest.raises(tpcompile.TPCompileError, match="use one of auto, replicate, sharded_output"):
        tpcompile.shard(build("gpt"), 2, plan={"lm_head": "rowwise"})


class DataDependent(nn.Module):
    """A model whose Python control flow depends on tensor values."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.fc(x)
        return -self.fc(x)


def test_uncapturable_model() -> None:
    """torch.export failure says what failed and what to try."""
    with pytest.raises(tpcompile.TPCompileError, match=r"torch.export could not capture DataDependent: .*\n  try: .*torch.cond"):
        tpcompile.shard(DataDependent(), 2, example_inputs=(torch.randn(2, 8),))


class ConvFirst(nn.Module):
    """A model whose first layer is no Linear or Embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(3, 8, 3)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x).mean(-1))


def test_no_example_inputs_and_none_inferable() -> None:
    """Without example inputs and a Conv first layer, the error says what to pass."""
    with pytest.raises(tpcompile.TPCompileError, match=r"first layer conv is a Conv1d.*pass example_inputs="):
        tpcompile.shard(ConvFirst(), 2)


def test_inputs_inferred_from_first_linear() -> None:
    """With no example inputs, a Linear-first model is captured from a guessed input."""
    model = build("mlp")
    sm = tpcompile.shard(model, 2)
    x = torch.randn(5, 64)
    with torch.no_grad():
        torch.testing.assert_close(tpcompile.simulate(sm, x)[0], model(x), atol=1e-5, rtol=0)


def test_bad_rank_index() -> None:
    """Asking for a rank outside the world is an error naming the rank."""
    sm = tpcompile.shard(build("mlp"), 2)
    with pytest.raises(tpcompile.TPCompileError, match="rank 2 is out of range for world size 2"):
        sm.rank(2)


@pytest.mark.parametrize("r, shown", [(-1, r"rank -1"), (True, r"rank True \(bool, not an int\)"),
                                      ("0", r"rank '0' \(str, not an int\)"), (1.0, r"rank 1\.0 \(float, not an int\)")])
def test_rank_index_must_be_an_int_in_range(r: object, shown: str) -> None:
    """Negative, bool, str or float ranks are refused, naming the value and the valid range."""
    sm = tpcompile.shard(build("mlp"), 2)
    with pytest.raises(tpcompile.TPCompileError, match=rf"{shown} is out of range for world size 2; ranks are the ints 0 to 1"):
        sm.rank(r)


def test_world_size_message_says_what_to_pass() -> None:
    """The world-size error names the type given and shows a valid call."""
    with pytest.raises(tpcompile.TPCompileError, match=r"got 2\.0 \(float\); pass the number of ranks, e.g\. world_size=2"):
        tpcompile.shard(build("mlp"), 2.0)


def _package_calls() -> list[tuple[str, int, ast.Call]]:
    """Every function call in the tpcompile package's source, with its file and line."""
    root = Path(tpcompile.__file__).parent
    calls = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                calls.append((str(path.relative_to(root)), node.lineno, node))
    return calls


def _dotted(func: ast.expr) -> str:
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        parts.append(func.id)
    return ".".join(reversed(parts))


def test_no_eval_exec_or_unsafe_loading_in_the_package() -> None:
    """No eval/exec, no pickle or full YAML loading, and torch.load only with weights_only=True."""
    calls = _package_calls()
    assert len(calls) > 500  # the scan really read the package
    # runtime.launch unpickles results its own child processes send back: data, not a user's file
    trusted = {("runtime/launch.py", "pickle.loads")}
    bad = []
    for where, line, call in calls:
        name = _dotted(call.func)
        builtin = isinstance(call.func, ast.Name) and name in ("eval", "exec", "compile", "__import__")
        if builtin or name in ("pickle.load", "pickle.loads", "yaml.load", "yaml.unsafe_load", "yaml.full_load",
                               "marshal.loads") and (where, name) not in trusted:
            bad.append(f"{where}:{line}: {name}(...)")
        if name == "torch.load":
            safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                       for k in call.keywords)
            if not safe:
                bad.append(f"{where}:{line}: torch.load without weights_only=True")
    assert not bad, bad
    assert any(_dotted(c.func) == "torch.load" for _, _, c in calls)  # the checkpoint loader is among them
