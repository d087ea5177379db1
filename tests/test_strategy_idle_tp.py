"""The planner never picks tensor parallelism that splits nothing: its ranks would repeat each other's work."""
from __future__ import annotations

import pytest

import tpcompile
from tpcompile.models import build


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_tiny_model_on_two_gpus_is_data_parallel(name: str) -> None:
    """A tiny model on 2 GPUs of one node trains data-parallel: at tp 2 the cost model would keep every unit
    whole (cheap on paper: no collectives, no gradient sync), which has both ranks do all the work."""
    s = tpcompile.plan_parallel(build(name), {"gpus": 2, "gpus_per_node": 2}, global_batch=8, seq_len=None)
    assert (s.tp, s.dp, s.pp) == (1, 2, 1), s.table()
    tp2 = [a for a in s.alternatives if a.tp == 2]
    # tp 2 competes with its units split, as tensor parallelism, and loses on its collectives
    assert tp2 and all(a.predicted_step_s > s.predicted_step_s and "tensor-parallel" in a.why_lost for a in tp2), \
        s.table()
    assert s.plan == {}  # no tensor parallelism, so no unit to keep whole
