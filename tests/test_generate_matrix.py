"""The generation matrix (pytest -m slow): six architectures, greedy tokens equal to HF generate at 2 and 4 simulated
ranks and at 2 torchrun ranks on gloo; `python bench/generate_matrix.py --write` records the same runs in
docs/generate.md."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from bench.generate_matrix import ARCHS, NEW_TOKENS, check_simulated, check_torchrun  # noqa: E402

KV_HEADS = {"llama": 2, "mistral": 2, "qwen2": 2, "gemma3": 2, "gpt2": 4, "phi": 4}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("arch", ARCHS)
def test_simulated_ranks_generate_hf_tokens(arch: str, world_size: int) -> None:
    """32 greedy tokens for two padded prompts equal HF generate's on every rank; a rank holds its kv heads of
    the cache (the shared pieces when kv heads are fewer than ranks)."""
    r = check_simulated(arch, world_size)
    assert r["same"], r
    assert r["cache_bytes"] * min(world_size, KV_HEADS[arch]) == r["cache_bytes_unsharded"]


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.parametrize("arch", ARCHS)
def test_torchrun_ranks_generate_hf_tokens(arch: str) -> None:
    """examples/generate.py under torchrun (2 gloo processes) generates HF generate's tokens; half the cache each."""
    r = check_torchrun(arch)
    assert r["same"], r
    assert r["new_tokens"] <= NEW_TOKENS and 2 * r["cache_bytes"] == r["cache_bytes_unsharded"]
