"""The torch floor pyproject declares is the torch the suite runs on, and the README says which versions are tested."""
from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def _minor(version: str) -> tuple[int, int]:
    """(2, 13) from '2.13.0+cpu' or '2.13'."""
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()  # type: ignore[union-attr]
    return int(major), int(minor)


def test_torch_floor_is_the_tested_torch() -> None:
    """pyproject's torch>=X.Y is a range whose floor is the torch this suite runs on and constraints.txt pins."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [d for d in deps if re.match(r"torch\b", d)]
    m = re.fullmatch(r"torch\s*>=\s*([\d.]+)", spec)
    assert m, f"{spec!r}: the torch requirement is a floor only (torch>=X.Y), no upper bound or pin"
    assert _minor(m[1]) == _minor(torch.__version__), (spec, torch.__version__)
    pins = re.findall(r"^torch==([\d.]+)", (ROOT / "constraints.txt").read_text(), flags=re.M)
    assert pins and _minor(pins[0]) == _minor(m[1])


def test_readme_names_the_tested_versions() -> None:
    """The README's 'Tested with' line names this suite's torch, Python and transformers versions."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    line = next((ln for ln in readme.splitlines() if ln.startswith("Tested with")), "")
    assert line, "README has no 'Tested with' line"
    py = f"Python {sys.version_info.major}.{sys.version_info.minor}"
    assert py in line and f"torch {'.'.join(map(str, _minor(torch.__version__)))}" in line, line
    import transformers
    assert f"transformers {'.'.join(map(str, _minor(transformers.__version__)))}" in line, line
