"""A GPT built on meta whose ~1 GB of weights sit in a safetensors file loads at 2 ranks in about a shard's memory.

Each rank process records its resident memory after its imports and before parallelize(),
resets the kernel's peak counter (VmHWM), parallelizes the meta model with the file as weights,
runs a forward, and reads the peak back. The launch is shared with the other runtime tests
(tests/dist_run.py): it writes the file (one tensor in memory at a time) and measures first.
"""
from __future__ import annotations

import pytest
import torch
from dist_run import results

pytestmark = pytest.mark.gloo

LIMIT = 0.7e9  # bytes above the baseline


def test_file_is_about_one_gigabyte() -> None:
    """The weights file the ranks read holds ~1 GB of float32 tensors."""
    assert 0.95e9 < results()["big_bytes"] < 1.1e9


@pytest.mark.parametrize("rank", [0, 1])
def test_rank_peak_memory_stays_under_0_7_gb(rank: int) -> None:
    """Peak RSS above the baseline < 0.7 GB; the rank holds about half the weights, all real."""
    mem = results()["ranks"][rank]["memory"]
    assert mem["meta_left"] == []
    assert 0.45 * results()["big_bytes"] < mem["held"] < 0.55 * results()["big_bytes"]
    assert mem["peak_above_baseline"] < LIMIT, (
        f"rank {rank} peaked {mem['peak_above_baseline'] / 1e9:.3f} GB above its baseline")


@pytest.mark.parametrize("rank", [0, 1])
def test_rank_logits_equal_the_whole_model(rank: int) -> None:
    """The loaded rank computes the unsharded model's logits (computed here from the same file)."""
    got = results()["ranks"][rank]["memory"]["logits"]
    torch.testing.assert_close(got, results()["big_reference"], rtol=1e-4, atol=1e-5)
