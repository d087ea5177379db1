"""Gradient accumulation across step() calls without a data-parallel sum per call, and CPU offload's refusal.

Both run in the mixed-precision launch (tests/precision_run.py), which starts the 2 gloo ranks once.
"""
from __future__ import annotations

import pytest
import torch

from precision_run import accumulated_reference, results


@pytest.mark.gloo
@pytest.mark.parametrize("data_parallel", ["fsdp", "ddp"])
def test_accumulation_sums_once_after_no_sync(data_parallel: str) -> None:
    """Two steps in hm.no_sync() and one after: no reduce-scatter inside, the three losses' summed gradients after."""
    want = accumulated_reference()
    for r in results():
        got = r["accumulate"][data_parallel]
        assert got["during"] == 0
        assert got["after"] > 0 or data_parallel == "ddp"  # (DDP's reducer is not a Python call to count)
        for name, g in got["grads"].items():
            assert torch.allclose(g, want[name], rtol=1e-9, atol=1e-12), name


@pytest.mark.gloo
def test_cpu_offload_is_refused_without_cuda() -> None:
    """cpu_offload=True on the CPU says there is nothing to offload from and the way out."""
    for r in results():
        assert "no CUDA device" in r["offload"] and "drop cpu_offload=True" in r["offload"]
