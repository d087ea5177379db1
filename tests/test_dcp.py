"""DCP checkpoints: saved by 2 gloo ranks, loaded back at 4 ranks and at 1 (at 2: tests/test_parallelize.py)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as stock_dcp
from dist_run import SMALL, results, small_inputs, small_model

import tpcompile
from tpcompile import dcp
from tpcompile.models import GPT

pytestmark = pytest.mark.gloo


def _other_weights() -> GPT:
    """The small GPT with weights unlike the saved ones, so a load visibly replaces them."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(123)
        return GPT(SMALL).eval()


def test_metadata_holds_global_shapes_and_chunks() -> None:
    """Entries are keyed by the original names with full shapes; a vocab split is two chunks."""
    md = stock_dcp.FileSystemReader(str(results()["ckpt"])).read_metadata()
    lm = md.state_dict_metadata["lm_head.weight"]
    assert tuple(lm.size) == (250, 64)
    assert sorted(tuple(c.offsets) for c in lm.chunks) == [(0, 0), (125, 0)]
    qkv = md.state_dict_metadata["transformer.h.0.attn.c_attn.weight"]
    # q|k|v segments of 64 rows, each split in two: six chunks of 32 rows
    assert sorted(c.offsets[0] for c in qkv.chunks) == [0, 32, 64, 96, 128, 160]
    assert set(md.state_dict_metadata) == set(small_model().state_dict())


def test_load_at_four_ranks() -> None:
    """Each of 4 ranks reads its slices (padded vocab of 250, q|k|v segments); outputs equal the original."""
    _, other = small_inputs()
    sm = tpcompile.shard(_other_weights(), 4)
    ranks = [sm.rank(r) for r in range(4)]
    for r, gm in enumerate(ranks):
        dcp.load(gm, results()["ckpt"], sharded=sm, rank=r, no_dist=True)
    assert ranks[3].lm_head.weight.shape == (63, 64)  # 250 padded to 252
    outs = tpcompile.simulate_ranks(4, lambda r: ranks[r](other))
    with torch.no_grad():
        want = small_model()(other)
        assert (_other_weights()(other) - want).abs().max() > 1e-3
    for out in outs:
        torch.testing.assert_close(out, want)


def test_load_at_one_rank_with_stock_dcp() -> None:
    """The checkpoint is plain DCP: torch's own load fills an unsharded model exactly."""
    _, other = small_inputs()
    model = _other_weights()
    state = model.state_dict()
    stock_dcp.load(state, checkpoint_id=str(results()["ckpt"]), no_dist=True)
    model.load_state_dict(state)
    for name, t in small_model().state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], t, atol=0, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(model(other), small_model()(other))


def test_missing_checkpoint_is_named(tmp_path) -> None:
    """Loading from a directory that does not exist names it."""
    gm = torch.fx.symbolic_trace(torch.nn.Identity())
    with pytest.raises(tpcompile.TPCompileError, match="does not exist"):
        dcp.load(gm, tmp_path / "nope", no_dist=True)
