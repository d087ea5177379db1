"""The command-line output pasted in the README is what the tool prints today."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tpcompile.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _block_after(readme: str, command: str) -> str:
    """The fenced block that follows the paragraph starting with `command` in the README."""
    start = readme.index(f"`{command}`")
    match = re.compile(r"```\n(.*?)```", re.S).search(readme, start)
    assert match is not None, command
    return match.group(1)


def test_readme_plan_is_current(capsys: pytest.CaptureFixture[str]) -> None:
    """The README's `tpcompile plan gpt` block is exactly today's output."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert main(["plan", "gpt"]) == 0
    assert _block_after(readme, "tpcompile plan gpt") == capsys.readouterr().out


def test_readme_diff_is_the_golden_text() -> None:
    """The README's `tpcompile diff gpt --rank 0` block starts the golden diff, which test_golden checks."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    shown = _block_after(readme, "tpcompile diff gpt --rank 0")
    assert shown.endswith("\n...\n")
    golden = (ROOT / "tests" / "golden" / "gpt_ws2.diff").read_text(encoding="utf-8")
    assert golden.startswith(shown[: -len("...\n")])
    assert "![" in readme and (ROOT / "docs" / "img" / "gpt_rank0.svg").is_file()


def test_readme_flags_are_taken_by_every_model_subcommand() -> None:
    """Each flag the README says every model subcommand takes parses on each subcommand it names."""
    from tpcompile.cli import build_parser

    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    sentence = readme.split("Every model subcommand (")[1].split("Errors are one line")[0]
    commands = re.findall(r"`(\w+)`", sentence.split(")")[0])
    flags = list(dict.fromkeys(re.findall(r"`(?:-\w/)?(--[\w-]+)[^`]*`", sentence)))
    assert commands == ["plan", "dump", "diff", "verify", "demo"]
    assert flags == ["--world-size", "--inputs", "--config", "--plan", "--sequence-parallel", "--debug"]
    values = {"--world-size": ["3"], "--inputs": ["2x8:long"], "--config": ["n_layer=1"], "--plan": ["p.yaml"]}
    parser = build_parser()
    for command in commands:
        for flag in flags:
            ns = parser.parse_args([command, "gpt", flag, *values.get(flag, [])])
            assert ns.command == command and ns.model == "gpt"


def test_readme_verify_block_has_todays_format() -> None:
    """The README's `tpcompile verify gpt` block has the lines the command prints today (numbers aside)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = _block_after(readme, "tpcompile verify gpt").splitlines()
    assert lines[0] == "verify GPT (gpt) at world size 2 on random inputs (2x16 int64, seed 1)"
    num = r"\d\.\d+e[-+]\d+"
    assert re.fullmatch(rf"output \(2x16x256\): max \|diff\| {num}, relative \d\.\de[-+]\d+, allowed \d\.\de-05 "
                        rf"\(rank 0 {num}, rank 1 {num}\)", lines[1]), lines[1]
    assert re.fullmatch(rf"OK: max \|diff\| {num} <= {num} = atol 1e-05 \+ rtol 1.3e-06 x max \|output\| [\d.]+ "
                        r"\(output\) over 2 ranks and 1 outputs", lines[2]), lines[2]


def test_torchs_future_warning_is_filtered_by_the_test_config(request: pytest.FixtureRequest) -> None:
    """The FutureWarning torch raises when copy.deepcopy meets its tree specs matches a filter of the test config."""
    import copy
    import warnings

    from torch.utils import _pytree as pytree

    spec = pytree.tree_flatten((1, 2))[1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        copy.deepcopy(spec)
    assert caught and all(w.category is FutureWarning for w in caught)
    ignored = [line.split(":") for line in request.config.getini("filterwarnings") if line.startswith("ignore:")]
    for w in caught:
        assert any(re.match(message, str(w.message)) and category == "FutureWarning"
                   for _, message, category, *_ in ignored), str(w.message)
