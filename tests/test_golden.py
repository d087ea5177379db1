"""Golden graph diffs: what sharding changes in each bundled model's captured graph, checked line by line.

Each case stores, under tests/golden/, exactly what `tpcompile diff MODEL -w N --rank R` prints
for one or more ranks: the collectives added, other nodes added, shape literals changed,
parameters sliced, nodes removed, and the unified diff of the code. A change to the sharding
passes that alters a rank's graph shows up here as a readable diff; if it is intended,
regenerate the files with

    python -m pytest tests/test_golden.py --update-golden

Each case also checks that the simulated ranks compute the original model's output.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import tpcompile
from tpcompile.models import build
from tpcompile.report.graph_diff import diff_text, diff_title

GOLDEN_DIR = Path(__file__).parent / "golden"
UPDATE_HINT = "python -m pytest tests/test_golden.py --update-golden"
MAX_REPORT_LINES = 60


@dataclass(frozen=True)
class Case:
    """One golden file: a bundled model sharded at a world size, diffed for some ranks."""

    model: str
    world_size: int
    sequence_parallel: bool = False
    ranks: tuple[int, ...] = (0,)

    @property
    def name(self) -> str:
        return f"{self.model}_ws{self.world_size}" + ("_sp" if self.sequence_parallel else "")

    @property
    def path(self) -> Path:
        return GOLDEN_DIR / f"{self.name}.diff"


CASES = [
    Case("mlp", 2),
    # Rank 1 too: its vocab-parallel embedding uses a different token range than rank 0.
    Case("gpt", 2, ranks=(0, 1)),
    Case("gpt-manual", 2),
    Case("gpt-sep", 2),
    Case("gpt-sep", 4),
    Case("gpt", 2, sequence_parallel=True),
]


def golden_text(sm: tpcompile.ShardedModel, case: Case) -> str:
    """The golden text of a case: `tpcompile diff` for each of its ranks."""
    title = diff_title(sm.model_name, case.model, sequence_parallel=case.sequence_parallel)
    return diff_text(sm, title, case.ranks)


def _short_diff(expected: str, actual: str) -> str:
    """A diff of the golden text against the new text, cut to MAX_REPORT_LINES lines."""
    lines = list(difflib.unified_diff(expected.splitlines(), actual.splitlines(), "golden", "now",
                                      n=1, lineterm=""))
    if len(lines) > MAX_REPORT_LINES:
        lines = lines[:MAX_REPORT_LINES] + [f"... ({len(lines) - MAX_REPORT_LINES} more lines)"]
    return "\n".join(lines)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_golden_graph_diff(case: Case, update_golden: bool) -> None:
    """The captured -> rank diff equals the stored golden file; the ranks match the model."""
    model = build(case.model)
    inputs = model.example_inputs()
    sm = tpcompile.shard(model, case.world_size, example_inputs=inputs,
                         sequence_parallel=case.sequence_parallel)
    actual = golden_text(sm, case)

    if update_golden:
        GOLDEN_DIR.mkdir(exist_ok=True)
        case.path.write_text(actual, encoding="utf-8")
    else:
        rel = case.path.relative_to(GOLDEN_DIR.parent.parent)
        if not case.path.exists():
            pytest.fail(f"golden file {rel} is missing; create it with: {UPDATE_HINT}")
        expected = case.path.read_text(encoding="utf-8")
        if actual != expected:  # pytest.fail, not assert: keep the report to the short diff
            pytest.fail(f"sharded graph for {case.name} differs from {rel}:\n{_short_diff(expected, actual)}\n"
                        f"If this change is intended, run: {UPDATE_HINT}")

    with torch.no_grad():
        ref = model(*inputs)
        outs = tpcompile.simulate(sm, *inputs)
    assert len(outs) == case.world_size
    for r, out in enumerate(outs):
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0, msg=lambda m, r=r: f"rank {r}: {m}")


def test_golden_sections_are_counted() -> None:
    """Each stored diff has the five sections with counts, and every collective it lists is in its code diff."""
    for case in CASES:
        text = case.path.read_text(encoding="utf-8")
        for heading in ("collectives added", "other nodes added", "shape literals changed (old -> new)",
                        "parameters sliced (old shape -> new shape)", "nodes removed"):
            assert text.count(f"## {heading}: ") == len(case.ranks), (case.name, heading)
        added = [line.split()[0] for line in text.split("## collectives added")[1].split("\n## ")[0].splitlines()[1:]
                 if line.strip() and line.strip() != "(none)"]
        assert added, f"{case.name}: a sharded model inserts collectives"
        for name in added:
            assert f"+    {name} = torch.ops.tpcompile." in text, (case.name, name)


def test_short_diff_reports_changed_lines() -> None:
    """A changed golden line shows as -old/+new in the failure report."""
    report = _short_diff("a\nview 4\nc\n", "a\nview 2\nc\n")
    assert "-view 4" in report and "+view 2" in report
