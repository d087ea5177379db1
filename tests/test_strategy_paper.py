"""The planner at full size on the meta device (slow): published Llama 3 layouts, data parallelism for 1B, planning time."""
from __future__ import annotations

import time
import warnings

import pytest
import torch

from bench import strategy_paper as paper
from tpcompile.strategy import Cluster, plan_parallel

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("case", paper.CHECKS, ids=[c[0] for c in paper.CHECKS])
def test_published_layouts(case: tuple) -> None:
    """70B on 256 and 405B on 512 H100s: tp within a node, pp only when needed, fits, throughput within 25%."""
    row = paper.check(*case, efficiency=paper.DEFAULT_EFFICIENCY)
    assert row["tp_within_node"] and row["pp_only_if_needed"] and row["fits"], row
    assert row["within_25pct"], row


def test_one_billion_on_one_node_prefers_data_parallelism() -> None:
    """Llama 3.2 1B on 8 GPUs of one node: the chosen layout is dp 8."""
    row = paper.dp_check(paper.DEFAULT_EFFICIENCY)
    assert row["ok"], row


def test_7b_plans_under_ten_seconds_mostly_capture() -> None:
    """A 32-layer Llama-2-7B-shaped model on the meta device plans in under 10 s; its alike layers are captured three
    times, not 32, and the planner's own work (tp profiles and search) stays under 3 s."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                         intermediate_size=11008, vocab_size=32000, use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    kwargs = {"input_ids": torch.ones(1, 8, dtype=torch.long, device="meta"), "use_cache": False}
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = plan_parallel(model, Cluster(gpus=64), example_kwargs=kwargs, global_batch=256, seq_len=4096)
    elapsed = time.perf_counter() - start
    assert elapsed < 10.0, f"planning took {elapsed:.1f} s (capture {s.capture_s:.1f} s)"
    assert elapsed - s.capture_s < 3.0, f"planning took {elapsed:.1f} s, of which capture only {s.capture_s:.1f} s"


def test_efficiency_default_is_the_fit() -> None:
    """The default efficiency is the one that reproduces the published calibration run."""
    profile, tpps, _ = paper.profile_of(paper.CALIBRATION[0], tp_max=1)
    assert paper.calibrate(profile, tpps) == pytest.approx(paper.DEFAULT_EFFICIENCY, abs=0.01)
