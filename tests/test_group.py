"""shard(..., group=pg) runs the ranks' collectives on that process group."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import tpcompile
from tpcompile.runtime import launch


def _child(rank: int) -> tuple[float, int]:
    from tpcompile.models import build
    from tpcompile.ops.collectives import record

    pg = dist.new_group([0, 1])
    model = build("gpt")
    sm = tpcompile.shard(model, 2, group=pg)
    idx = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), record() as events:
        out = sm.rank(rank)(idx)
        ref = model(idx)
    return float((out - ref).abs().max()), len(events)


@pytest.mark.gloo
def test_explicit_process_group() -> None:
    """Both ranks, sharded with an explicit gloo group, equal the original and communicate."""
    results = launch(2, _child, timeout=90)
    for diff, events in results:
        assert diff <= 1e-5
        assert events == 6


def test_group_of_wrong_size_is_an_error() -> None:
    """A group whose size differs from world_size is rejected with both numbers."""
    class FakeGroup:
        def size(self) -> int:
            return 4

    with pytest.raises(tpcompile.TPCompileError, match="group has 4 ranks but world_size is 2"):
        tpcompile.shard(torch.nn.Linear(4, 4), 2, group=FakeGroup())


def test_hugging_face_dummy_inputs_are_used() -> None:
    """A Hugging Face model with no example inputs is captured from its dummy_inputs."""
    pytest.importorskip("transformers")
    from hf_models import ARCHS, build
    model = build(ARCHS[0])
    sm = tpcompile.shard(model, 2)
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
        out = tpcompile.simulate(sm, input_ids=ids, use_cache=False)[1].logits
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
