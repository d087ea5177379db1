"""Shared fixtures: single-threaded torch, and small helpers to compare sharded runs."""
from __future__ import annotations

import os

import pytest
import torch

# The command's progress lines (stderr in a pipe, cli/progress.py) come from steps that outlast a second,
# which a loaded machine makes of any step: tests of one-line errors would see them. The tests of progress
# itself turn it back on.
os.environ.setdefault("TPCOMPILE_PROGRESS", "0")

# Simulated ranks are threads sharing this machine's cores: one intra-op thread each keeps every
# rank's arithmetic identical from run to run (a GEMM split over a varying number of threads can
# round differently) and avoids oversubscribing the cores.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)


def max_diff(outs: list, ref: torch.Tensor) -> float:
    """Largest absolute difference between any rank's output and the reference."""
    return max(float((o - ref).abs().max()) for o in outs)


def pytest_addoption(parser: pytest.Parser) -> None:
    """--update-golden: rewrite the golden graph diffs under tests/golden instead of comparing."""
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="rewrite tests/golden/*.diff from the current sharding output")


@pytest.fixture
def update_golden(request: pytest.FixtureRequest) -> bool:
    """True when pytest ran with --update-golden."""
    return bool(request.config.getoption("--update-golden"))
