"""No package reads another package's private attributes: neighbours go through public surfaces."""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import tpcompile

ROOT = Path(tpcompile.__file__).parent


def _package(path: Path, root: Path) -> str:
    """The package a module belongs to: its first directory under the root ('' for top-level modules)."""
    parts = path.relative_to(root).parts
    return parts[0] if len(parts) > 1 else ""


def _private(name: str) -> bool:
    """A single-underscore name (dunders are the language's, not anyone's private state)."""
    return name.startswith("_") and not name.startswith("__")


def _defined(tree: ast.AST) -> set[str]:
    """The private attributes a module's classes define: self._x assignments, _x methods and class fields."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(item.name):
                    out.add(item.name)
                targets = item.targets if isinstance(item, ast.Assign) else \
                    [item.target] if isinstance(item, ast.AnnAssign) else []
                out.update(t.id for t in targets if isinstance(t, ast.Name) and _private(t.id))
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        out.update(t.attr for t in targets if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                   and t.value.id == "self" and _private(t.attr))
    return out


def _other_libraries(tree: ast.AST) -> set[str]:
    """The names a module binds by importing from other libraries (`torch`, `nn`, ...): their privates are theirs."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update((a.asname or a.name.split(".")[0]) for a in node.names if not a.name.startswith("tpcompile"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and not (node.module or "").startswith("tpcompile"):
            out.update(a.asname or a.name for a in node.names)
    return out


def foreign_reads(root: Path) -> list[str]:
    """'file:line: ._x (defined in package P)' for each read of a private attribute another package defines.

    A read through `self` or `cls` is the class's own; an attribute that the reading package defines
    too is taken as its own (its name is ambiguous); torch's private attributes are not ours to police.
    """
    trees = {p: ast.parse(p.read_text(), str(p)) for p in sorted(root.rglob("*.py"))}
    owners: dict[str, set[str]] = defaultdict(set)
    for path, tree in trees.items():
        for name in _defined(tree):
            owners[name].add(_package(path, root))
    found = []
    for path, tree in trees.items():
        package, libraries = _package(path, root), _other_libraries(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr) and node.attr in owners):
                continue
            if isinstance(node.value, ast.Name) and (node.value.id in ("self", "cls") or node.value.id in libraries):
                continue
            if package in owners[node.attr]:
                continue
            where = ", ".join(sorted(p or "the top level" for p in owners[node.attr]))
            found.append(f"{path.relative_to(root)}:{node.lineno}: .{node.attr} (defined in {where})")
    return found


def test_no_package_reads_another_packages_private_attributes() -> None:
    """checkpoint/, hybrid/, generate/, strategy/ and the rest read ShardedModel and friends by public names."""
    found = foreign_reads(ROOT)
    assert not found, "private attributes read across packages; add a public property instead:\n" + "\n".join(found)


def test_the_check_finds_a_foreign_read(tmp_path: Path) -> None:
    """A module reading `sm._ctx` that another package's class defines is reported; `self._ctx` and torch's are not."""
    (tmp_path / "api.py").write_text("class S:\n    def __init__(self):\n        self._ctx = 1\n"
                                     "    def get(self):\n        return self._ctx\n")
    (tmp_path / "hybrid").mkdir()
    (tmp_path / "hybrid" / "train.py").write_text("import torch\n\n\ndef f(sm):\n    torch._ctx\n"
                                                  "    return sm._ctx, sm._other\n")
    assert foreign_reads(tmp_path) == ["hybrid/train.py:6: ._ctx (defined in the top level)"]
