"""The README and docs/cli.md as a newcomer reads them: commands that run as written from a fresh clone, a pytest
selection that selects what it says, and a section for every subcommand."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

from _pytest.mark.expression import Expression

from tpcompile.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
# commands a reader runs; from a fresh clone without an activated venv they live in .venv/bin
VENV_TOOLS = ("python", "python3", "torchrun", "tpcompile", "pytest", "pip")


def _readme() -> str:
    """The README's text."""
    return (ROOT / "README.md").read_text(encoding="utf-8")


def _shell_blocks(text: str) -> list[str]:
    """The lines of every fenced block that is not Python (those are commands or outputs)."""
    blocks = re.findall(r"```(\w*)\n(.*?)```", text, re.S)
    return [line for lang, body in blocks if lang != "python" for line in body.splitlines()]


def test_readme_commands_name_the_venv() -> None:
    """Every command line in the README's blocks starts with .venv/bin/ (or makes the venv): none needs an
    activated environment."""
    bare = []
    for line in _shell_blocks(_readme()):
        for command in (c.strip() for c in line.split("#")[0].split("&&")):
            words = command.split(" ")
            output = len(words) > 1 and words[1].endswith(":")  # a printed header: 'tpcompile plan: GPT ...'
            if words[0] in VENV_TOOLS and not output and not command.startswith("python3 -m venv"):
                bare.append(line)
    assert not bare, bare


def test_readme_marker_selections_keep_the_defaults_out() -> None:
    """Each `pytest -m '...'` the README offers selects what it names and still leaves out the other markers the
    default run (pyproject's addopts) leaves out: a -m on the command line replaces the default one."""
    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    default = Expression.compile(re.search(r"-m\s+'([^']+)'", addopts).group(1)).evaluate
    markers = ("slow", "hybrid", "gloo", "restart")
    left_out = [m for m in markers if not default(lambda name, m=m: name == m)]
    assert {"slow", "hybrid", "gloo", "restart"} <= set(left_out)
    offered = [" ".join(e.split()) for e in re.findall(r"pytest(?:\s+-\w+)*\s+-m\s+'([^']+)'", _readme())]
    assert "gloo and not slow and not hybrid and not restart" in offered
    for expr in offered:
        match = Expression.compile(expr).evaluate
        named = [m for m in markers if re.search(rf"(?<!not )\b{m}\b", expr)]
        for marker in named:
            assert match(lambda name, m=marker: name == m), (expr, marker)  # it selects what it names
        for marker in set(left_out) - set(named):  # and keeps the rest out, also from tests it selects
            assert not match(lambda name, m=marker: name == m or name in named), (expr, marker)


def test_cli_doc_has_a_section_per_subcommand() -> None:
    """docs/cli.md has a '## name' section for every subcommand, says ranks take the same inputs, and its
    progress and backend notes match the code."""
    doc = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    names = [n for n in sub.choices if n != "check"]
    assert {"strategy", "generate"} <= set(names)
    for name in names:
        assert re.search(rf"^## {name}\b", doc, re.M), name
    assert "every rank must be given the same inputs" in " ".join(doc.lower().split())
    assert "TPCOMPILE_PROGRESS=0" in doc and "--backend nccl" in doc
