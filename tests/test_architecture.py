"""The package's shape: no import cycle, small modules, few modules at the top level, every rule findable."""
from __future__ import annotations

import ast
from pathlib import Path

import tpcompile

ROOT = Path(tpcompile.__file__).parent


def _module_file(dotted: str) -> Path | None:
    """The file of module `tpcompile.a.b` (a.b.py or a/b/__init__.py), None when it is not a module."""
    parts = dotted.split(".")[1:]
    base = ROOT.joinpath(*parts) if parts else ROOT
    if base.with_suffix(".py").is_file() and parts:
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def _edges(path: Path) -> set[Path]:
    """The package modules `path` imports (anywhere in the file), with the subpackages they run first.

    A module's own enclosing packages have begun running before it does, so importing through
    them triggers nothing new; the root package's __init__ is the public API and left out too.
    """
    out: set[Path] = set()
    own = {p / "__init__.py" for p in path.parents}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if not name.startswith("tpcompile."):
                continue
            parts = name.split(".")
            for k in range(2, len(parts) + 1):  # subpackages run their __init__ first (the root's is left out)
                f = _module_file(".".join(parts[:k]))
                if f is not None and f != path and f not in own:
                    out.add(f)
    return out


def _graph() -> dict[Path, set[Path]]:
    return {p: _edges(p) for p in ROOT.rglob("*.py")}


def find_cycle(graph: dict) -> list | None:
    """A list of nodes forming a cycle in `graph` (node -> the nodes it points to), or None."""
    state: dict = {}  # 1: on the current path, 2: done
    stack: list = []

    def visit(p: object) -> list | None:
        state[p] = 1
        stack.append(p)
        for q in sorted(graph.get(p, ()), key=str):
            if state.get(q) == 1:
                return stack[stack.index(q):] + [q]
            if q not in state:
                found = visit(q)
                if found:
                    return found
        stack.pop()
        state[p] = 2
        return None

    for p in sorted(graph, key=str):
        if p not in state:
            found = visit(p)
            if found:
                return found
    return None


def test_no_import_cycle() -> None:
    """No module of the package imports, directly or through others, a module that imports it back."""
    graph = _graph()
    assert len(graph) > 40 and ROOT / "ops" / "collectives.py" in graph[ROOT / "ops" / "__init__.py"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(str(c.relative_to(ROOT)) for c in cycle)


def test_cycle_finder_finds_cycles() -> None:
    """The finder reports a cycle three modules long and passes a chain."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_modules_are_small_and_the_top_level_is_short() -> None:
    """No module over ~300 lines; at most 8 modules at the top level besides the packages."""
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py") if (n := len(p.read_text().splitlines())) > 320}
    assert not long, long
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(top) <= 8, top


def test_every_declared_dependency_is_imported() -> None:
    """pyproject's runtime dependencies are each imported by the package, and no third-party import is undeclared."""
    import tomllib
    deps = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["project"]["dependencies"]
    declared = {d.split(">")[0].split("=")[0].split("<")[0].split("[")[0].strip().lower() for d in deps}
    module_of = {"pyyaml": "yaml"}
    torch_needs = {"numpy"}  # torch's NumPy bridge warns at import without it (pyproject.toml says so)
    imported: set[str] = set()
    for p in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    for dep in declared - torch_needs:
        assert module_of.get(dep, dep) in imported, f"{dep} is declared but never imported"
    import sys
    third_party = {m for m in imported if m not in sys.stdlib_module_names and m != "tpcompile"}
    # imported only for hf: models, and for the profile's chart (--png): each named in the error when missing
    optional = {"transformers", "matplotlib"}
    assert third_party - optional <= {module_of.get(d, d) for d in declared}, third_party


def test_ops_doc_is_current(update_golden: bool) -> None:
    """docs/ops.md (op -> rule -> function) is what the op table and the registered rules say today."""
    from tpcompile.report.op_table import op_table_markdown
    doc = ROOT.parent / "docs" / "ops.md"
    text = op_table_markdown()
    if update_golden:
        doc.write_text(text)
    assert doc.read_text() == text, "docs/ops.md is stale: python -m tpcompile.report.op_table > docs/ops.md"
    assert "| `aten.linear.default` | weight_matmul |" in text


def _package(path: Path) -> str:
    """'checkpoint' for tpcompile/checkpoint/dcp.py; '' for a module at the top level (api.py)."""
    parts = path.relative_to(ROOT).parts
    return parts[0] if len(parts) > 1 else ""


def _private_reads(sources: dict[Path, str]) -> list[str]:
    """`obj._name` read in one package where `_name` is an attribute only another package's classes set
    (`self._name = ...`): a neighbour reaching into another's state instead of its public surface."""
    trees = {p: ast.parse(text) for p, text in sources.items()}
    owners: dict[str, set[str]] = {}
    for path, tree in trees.items():
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name) \
                    and n.value.id == "self" and n.attr.startswith("_") and not n.attr.startswith("__"):
                owners.setdefault(n.attr, set()).add(_package(path))
    found = []
    for path, tree in trees.items():
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and n.attr in owners and _package(path) not in owners[n.attr] \
                    and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")):
                found.append(f"{path.relative_to(ROOT)}:{n.lineno} reads .{n.attr} (set in "
                             f"{', '.join(sorted(o or 'the top level' for o in owners[n.attr]))})")
    return found


def test_no_package_reads_another_packages_private_state() -> None:
    """checkpoint/, hybrid/, generate/ and strategy/ use ShardedModel's public surface, not `sm._ctx`."""
    assert _private_reads({p: p.read_text() for p in ROOT.rglob("*.py")}) == []


def test_private_read_finder_finds_them() -> None:
    sources = {ROOT / "api.py": "class S:\n    def __init__(self):\n        self._ctx = 1\n",
               ROOT / "hybrid" / "x.py": "def f(sm):\n    return sm._ctx\n"}
    assert _private_reads(sources) == ["hybrid/x.py:2 reads ._ctx (set in the top level)"]
