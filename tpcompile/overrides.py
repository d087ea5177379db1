"""The user's overrides of the automatic choice: `shard(plan=...)`, a dict or a YAML plan file.

Each entry is `module.path: replicate | sharded_output | auto` and covers that module's subtree
(`override_for`: the longest matching prefix wins). Files are parsed with the safe loader only
(no Python objects, no tags) and checked against that schema; every error names the file, the
key and its line. `load_overrides(path)` returns a dict usable as `tpcompile.shard(plan=...)`,
which also accepts the path itself. (`Plan`, in passes/plan.py, is what shard() decided.)
"""
from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any, Union

import yaml

from tpcompile.errors import TPCompileError

OVERRIDE_VALUES = ("auto", "replicate", "sharded_output")
_PATH = re.compile(r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*$")  # 'transformer.h.0.attn'
EXAMPLE = "transformer.h.0.attn: replicate"


class Overrides(dict):
    """Overrides loaded from a file: module path -> value, remembering the file and each key's line."""

    def __init__(self, entries: dict[str, str], path: str, lines: dict[str, int]) -> None:
        super().__init__(entries)
        self.path = path
        self.lines = lines

    def where(self, key: str) -> str:
        """'plan.yaml line 3' for a key, for messages."""
        return f"{self.path} line {self.lines[key]}" if key in self.lines else self.path


def load_overrides(path: Union[str, os.PathLike]) -> Overrides:
    """Read and validate a YAML plan file; a TPCompileError names the key and line of any fault."""
    p = Path(path)
    if not p.is_file():
        raise TPCompileError(f"plan file {str(p)!r} does not exist or is not a file; pass the path of a YAML file "
                             f"with lines like '{EXAMPLE}'")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TPCompileError(f"plan file {p} cannot be read as UTF-8 text ({e}); save it as a UTF-8 YAML file") from e
    return parse_overrides(text, str(p))


def parse_overrides(text: str, source: str = "<plan>") -> Overrides:
    """Validate YAML plan text (see load_overrides); `source` names it in messages."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        raise TPCompileError(f"plan file {source}: YAML syntax error{_mark(e)}: {_problem(e)}; "
                             f"each line should read like '{EXAMPLE}'") from e
    if root is None:
        return Overrides({}, source, {})
    if not isinstance(root, yaml.MappingNode):
        raise TPCompileError(f"plan file {source} line {root.start_mark.line + 1}: the top level is a "
                             f"{_kind(root)}, not a mapping; write one 'module.path: value' per line, e.g. '{EXAMPLE}'")
    entries: dict[str, str] = {}
    lines: dict[str, int] = {}
    for key_node, value_node in root.value:
        line = key_node.start_mark.line + 1
        index = key_node.tag == "tag:yaml.org,2002:int" and key_node.value.isdigit()  # nn.Sequential's '0'
        if not isinstance(key_node, yaml.ScalarNode) or (key_node.tag != "tag:yaml.org,2002:str" and not index):
            raise TPCompileError(f"plan file {source} line {line}: key {_show(key_node)} is not a module path; "
                                 f"keys are dotted module names such as 'transformer.h.0.attn'")
        key = key_node.value
        if not _PATH.match(key):
            raise TPCompileError(f"plan file {source} line {line}: key {key!r} is not a module path (dotted names "
                                 f"of letters, digits and _ as in model.named_modules()), e.g. '{EXAMPLE}'")
        if key in lines:
            raise TPCompileError(f"plan file {source} line {line}: key {key!r} repeats line {lines[key]}; "
                                 f"keep one entry per module")
        if not isinstance(value_node, yaml.ScalarNode) or value_node.value not in OVERRIDE_VALUES \
                or value_node.tag != "tag:yaml.org,2002:str":
            raise TPCompileError(f"plan file {source} line {value_node.start_mark.line + 1}: {key}: "
                                 f"{_show(value_node)} is not a plan value; use one of {', '.join(OVERRIDE_VALUES)}")
        entries[key], lines[key] = value_node.value, line
    return Overrides(entries, source, lines)


def _mark(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    return "" if mark is None else f" at line {mark.line + 1}, column {mark.column + 1}"


def _problem(e: yaml.YAMLError) -> str:
    return " ".join(str(x) for x in (getattr(e, "context", None), getattr(e, "problem", None)) if x) or str(e)


def _kind(node: Any) -> str:
    return {yaml.SequenceNode: "list", yaml.MappingNode: "mapping"}.get(type(node), "single value")


def _show(node: Any) -> str:
    """A node as the user wrote it, shortened."""
    if isinstance(node, yaml.ScalarNode):
        return repr(node.value) if node.tag == "tag:yaml.org,2002:str" else f"{node.value} ({node.tag.rsplit(':', 1)[-1]})"
    return f"a {_kind(node)}"


def check_overrides(plan: Any, paths: set[str]) -> dict[str, str]:
    """The overrides as a dict, read from a YAML file when given a path; every key a module of the model."""
    if plan is None:
        return {}
    if isinstance(plan, (str, os.PathLike)):
        plan = load_overrides(plan)
    if not isinstance(plan, dict):
        raise TPCompileError(f"plan must be a dict of module path -> one of {', '.join(OVERRIDE_VALUES)}, or the path "
                             f"of a YAML plan file; got {type(plan).__name__}")
    where = (lambda k: f" ({plan.where(k)})") if isinstance(plan, Overrides) else (lambda k: "")  # noqa: E731
    for key, value in plan.items():
        if key not in paths:
            close = difflib.get_close_matches(str(key), sorted(paths), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else "; see model.named_modules() for the names"
            raise TPCompileError(f"plan names module {key!r}{where(key)}, which the model does not have{hint}")
        if not isinstance(value, str) or value not in OVERRIDE_VALUES:
            raise TPCompileError(f"plan[{key!r}] = {value!r}{where(key)}; use one of {', '.join(OVERRIDE_VALUES)}")
    return dict(plan)


def override_for(overrides: dict[str, str], module_path: str) -> str:
    """The override covering a module path (longest matching prefix), default 'auto'."""
    best, value = -1, "auto"
    for key, v in overrides.items():
        if (module_path == key or module_path.startswith(key + ".") or key == "") and len(key) > best:
            best, value = len(key), v
    return value
