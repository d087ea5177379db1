"""Zoo architectures at 3 ranks, where 4 heads, 2 kv heads and widths of 64 do not divide: split as at 2 and 4.

Bamba (Mamba-2 mixer): its heads zero-padded meet the one group of B and C shared by every rank, an einsum, an F.pad
along the tokens, the parts of a split and a gated RMSNorm over the padded heads' features. Falcon-H1: a buffer
(mup_vector) multiplies the mixer's fused projection, whose segments are zero-padded each.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
pytest.importorskip("transformers")
from bench import zoo  # noqa: E402


@pytest.mark.parametrize("arch", ["bamba", "falcon_h1"])
def test_mamba_mixers_split_at_three_ranks(arch: str) -> None:
    """Equal to the original on another batch and length, nothing replicated with a warning, the mixer's
    projections split (held x ws as at 2 ranks or better than replicating: below 1.35)."""
    row = zoo.run_ws(arch, 3)
    assert row["equal"], row.get("reason")
    assert row["warnings"] == []
    assert row["share"] * 3 < 1.35
