"""parallelize() inside a real 2-rank gloo group: meta models, checkpoint weights, the generate example."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_run import SMALL, results, small_inputs, small_model

import tpcompile
from tpcompile.models import GPT
from tpcompile.runtime import init_from_env


@pytest.mark.gloo
@pytest.mark.parametrize("rank", [0, 1])
def test_meta_model_with_checkpoint_weights(rank: int) -> None:
    """A GPT built on meta gets real local tensors from a DCP checkpoint; its output equals the original's."""
    res = results()["ranks"][rank]["from_dcp"]
    assert res["devices"] == ["cpu"]
    assert res["shapes"]["transformer.h.0.attn.c_attn.weight"] == (96, 64)  # q|k|v, half of each
    assert res["shapes"]["lm_head.weight"] == (125, 64)  # half the vocabulary of 250
    assert res["shapes"]["transformer.ln_f.weight"] == (64,)
    _, other = small_inputs()
    with torch.no_grad():
        torch.testing.assert_close(res["out"], small_model()(other))


@pytest.mark.gloo
def test_meta_model_without_weights_is_an_error() -> None:
    """parallelize of a meta model with no weights says what to pass."""
    assert "needs weights=" in results()["ranks"][0]["no_weights"]


@pytest.mark.gloo
def test_generate_example_runs_in_the_group() -> None:
    """examples/generate.py on 2 ranks: rank 0 prints 6 tokens equal to the unsharded model's, rank 1 nothing."""
    r0, r1 = results()["ranks"]
    lines = r0["generate"].strip().splitlines()
    assert lines[0].startswith("world size 2 on gloo")
    assert len(lines[1].removeprefix("generated ").strip("[]").split(",")) == 6
    assert lines[2] == "OK (same tokens as the unsharded model)"
    assert r1["generate"] == ""


@pytest.mark.gloo
def test_torchrun_gpt_example_runs_in_the_group() -> None:
    """examples/torchrun_gpt.py on 2 ranks: rank 0 reports a sharded parameter count and OK, rank 1 nothing."""
    r0, r1 = results()["ranks"]
    lines = r0["torchrun_gpt"].strip().splitlines()
    assert lines[0].startswith("world size 2 on gloo: rank 0 holds ")
    held, total = (int(x.replace(",", "")) for x in lines[0].split("holds ")[1].split(" parameters")[0].split(" of "))
    assert held < 0.6 * total
    assert lines[1] == "OK"
    assert r1["torchrun_gpt"] == ""


def test_parallelize_needs_a_process_group() -> None:
    """Without torch.distributed initialised, parallelize points to torchrun or shard()."""
    with pytest.raises(tpcompile.TPCompileError, match="initialised process group"):
        tpcompile.parallelize(small_model())


@pytest.mark.gloo
def test_one_rank_group_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-rank group (standalone, no torchrun): a meta GPT with inferred inputs and a state dict runs."""
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.setenv(key, "x")  # recorded as absent, so the test leaves the environment as it was
        monkeypatch.delenv(key)
    init_from_env(standalone=True)
    try:
        with torch.device("meta"):
            meta = GPT(SMALL).eval()
        gm = tpcompile.parallelize(meta, weights=small_model().state_dict())
        assert gm.meta["tpcompile"].world_size == 1 and gm.meta["tpcompile_rank"] == 0
        _, other = small_inputs()
        with torch.no_grad():
            torch.testing.assert_close(gm(other), small_model()(other))
    finally:
        dist.destroy_process_group()
