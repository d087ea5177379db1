"""The zoo under sequence parallelism (bench/zoo_sp.py): its docs section is its cache rendered, and a row is equal
only when both its logits and its gradients are."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
pytest.importorskip("transformers")
from bench import zoo, zoo_sp  # noqa: E402


def test_docs_section_is_the_cache_rendered() -> None:
    """docs/architectures.md's section on the zoo under sequence parallelism is what bench/zoo_sp.py makes of its
    cache, never typed, and the cache has a row for every architecture of the zoo."""
    ws = zoo_sp.WORLD_SIZE
    meta, rows = zoo.load_cache(zoo_sp.cache_path(ws))
    names = zoo.zoo_types()
    assert [n for n in names if n not in rows] == [], "python -m bench.zoo_sp runs the missing rows"
    begin, end = zoo_sp.markers(ws)
    text = zoo.DOCS.read_text(encoding="utf-8")
    assert begin in text and end in text, "python -m bench.zoo_sp --render writes it"
    section = begin + text.split(begin, 1)[1].split(end, 1)[0] + end
    assert section + "\n" == zoo_sp.render({n: rows[n] for n in names}, meta, ws), \
        "stale: python -m bench.zoo_sp --render"


def test_a_row_is_equal_only_with_its_gradients() -> None:
    """Logits equal but a gradient not: not equal, for the gradient's reason; no gradient check at all (the logits
    differed first): not equal, for the logits' reason; both: equal."""
    row = {"ws": {"5": {"equal": True, "grads": False, "reason": "FAIL: gradient of w on rank 3"}}}
    assert zoo_sp.verdict(row, 5) == (False, "FAIL: gradient of w on rank 3")
    row = {"ws": {"5": {"equal": False, "reason": "output logits differs by 1e-01"}}}
    assert zoo_sp.verdict(row, 5) == (False, "output logits differs by 1e-01")
    assert zoo_sp.verdict({"ws": {"5": {"equal": True, "grads": True}}}, 5) == (True, "")
    assert zoo_sp.verdict({"reason": "crashed: x"}, 5) == (False, "crashed: x")
