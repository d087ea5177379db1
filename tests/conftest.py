"""Shared fixtures: single-threaded torch, and small helpers to compare sharded runs."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)


def max_diff(outs: list, ref: torch.Tensor) -> float:
    """Largest absolute difference between any rank's output and the reference."""
    return max(float((o - ref).abs().max()) for o in outs)
