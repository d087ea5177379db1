"""docs/troubleshooting.md: at least 12 symptoms, each with the message the user sees; every TPCompileError that the
runtime, checkpoint and hybrid packages (and the rank graphs' guards) raise can be found there by its words."""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Iterator, Optional

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "troubleshooting.md"
SOURCES = ["tpcompile/runtime", "tpcompile/checkpoint", "tpcompile/hybrid", "tpcompile/ops/guards.py"]
WORDS = 6  # how many of a message's fixed leading words the page must hold
RAISED = ("TPCompileError", "InputShapeError")  # the error classes whose messages are read (the guards' subclass)
EDGES = " \t\n:;,.()'\""  # punctuation a run of fixed words is cut at (where the values sat)
# Messages with no run of three fixed words: nothing to search the page by (file: the function raising it, why).
EXCLUDED = {
    ("tpcompile/runtime/agreement.py", "agree_program"):
        "'{entry}: {why}': the words are startup_check's 'collective schedules differ between ranks at'",
    ("tpcompile/runtime/launch.py", "launch"): "'rank R failed: <its traceback>': the words are the rank's own error",
    ("tpcompile/runtime/simulator.py", "simulate_ranks"):
        "'simulated rank R failed: <its error>': the words are the rank's own error",
}


def _fragments(expr: ast.AST, fn: Optional[ast.AST], defs: dict[str, ast.AST]) -> Iterator[str]:
    """The fixed text pieces of a message expression, in order (names and helpers it calls followed one level)."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        yield expr.value
    elif isinstance(expr, ast.JoinedStr):
        for v in expr.values:
            if isinstance(v, ast.Constant):
                yield str(v.value)
            else:
                yield "\0"  # an interpolated value breaks a run of fixed words
    elif isinstance(expr, ast.BinOp):
        yield from _fragments(expr.left, fn, defs)
        yield from _fragments(expr.right, fn, defs)
    elif isinstance(expr, ast.IfExp):
        yield from _fragments(expr.body, fn, defs)
        yield from _fragments(expr.orelse, fn, defs)
    elif isinstance(expr, ast.Call):
        for a in [*expr.args, *(k.value for k in expr.keywords)]:
            yield from _fragments(a, fn, defs)
            yield "\0"  # each argument is a message part of its own
        name = getattr(expr.func, "id", None) or getattr(expr.func, "attr", None)
        helper = defs.get(name or "")
        if helper is not None and helper is not fn:
            for node in ast.walk(helper):
                if isinstance(node, ast.Return) and node.value is not None:
                    yield from _fragments(node.value, helper, {})
    elif isinstance(expr, ast.Name) and fn is not None:
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == expr.id for t in node.targets):
                yield from _fragments(node.value, fn, defs)


def _leading_words(expr: ast.AST, fn: Optional[ast.AST], defs: dict[str, ast.AST]) -> Optional[str]:
    """The first WORDS words of the message's first run of at least three fixed words, else None."""
    for piece in "".join(_fragments(expr, fn, defs)).split("\0"):
        words = [w for w in re.split(r"\s+", piece.strip(EDGES)) if w]
        if len(words) >= 3:
            return " ".join(words[:WORDS]).strip(EDGES)
    return None


def messages() -> list[tuple[str, str, Optional[str]]]:
    """(file, enclosing function, leading words or None) of every `raise TPCompileError(...)` in SOURCES."""
    out = []
    files = [p for s in SOURCES for p in ((ROOT / s).rglob("*.py") if (ROOT / s).is_dir() else [ROOT / s])]
    for path in sorted(files):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        defs = {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        for fn in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            for node in ast.walk(fn):
                call = node.exc if isinstance(node, ast.Raise) else None
                if isinstance(call, ast.Call) and getattr(call.func, "id", None) in RAISED and call.args:
                    out.append((str(path.relative_to(ROOT)), fn.name, _leading_words(call.args[0], fn, defs)))
    return sorted(set(out), key=lambda m: (m[0], m[1], m[2] or ""))


def _flat(text: str) -> str:
    """text without backticks, its whitespace runs one space, lower case."""
    return " ".join(text.replace("`", "").split()).lower()


def test_every_error_message_is_on_the_page() -> None:
    """Each message's fixed leading words appear in the page (backticks and line breaks aside)."""
    page = _flat(PAGE.read_text(encoding="utf-8"))
    found = messages()
    assert len(found) > 80  # the walk really reads the packages
    missing = [m for m in found if m[2] is not None and _flat(m[2]) not in page]
    assert not missing, "\n".join(f"{f} ({fn}): {w!r}" for f, fn, w in missing)
    wordless = {(f, fn) for f, fn, w in found if w is None}
    assert wordless == set(EXCLUDED), wordless ^ set(EXCLUDED)


def test_the_page_has_twelve_symptoms_with_messages() -> None:
    """At least 12 '### ' symptoms, each with a quoted message block and a fix."""
    text = PAGE.read_text(encoding="utf-8")
    symptoms = text.split("\n## Symptoms\n")[1].split("\n## ")[0]
    sections = re.split(r"^### ", symptoms, flags=re.M)[1:]
    assert len(sections) >= 12, len(sections)
    for s in sections:
        title = s.splitlines()[0]
        assert "```" in s, f"{title}: no message the user sees"
        assert re.search(r"\*\*(Fix|Way out)\*\*", s), f"{title}: no fix"
    for words in ("NCCL_DEBUG=INFO", "TORCH_DISTRIBUTED_DEBUG=DETAIL", "CUDA_VISIBLE_DEVICES",
                  "TORCH_NCCL_ASYNC_ERROR_HANDLING", "tpcompile profile", "TPCOMPILE_LOG"):
        assert words in text, words
