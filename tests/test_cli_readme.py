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
