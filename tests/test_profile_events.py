"""Reading profiler events as steps: blocks, collectives, backward linked by sequence number, waits, the report."""
from __future__ import annotations

import pytest

from tpcompile.report.profile_report import build_report
from tpcompile.runtime.profiler import RankProfile
from tpcompile.runtime.profiler_events import Event, read_steps
from tpcompile.runtime.profiler_marks import BLOCK, COLLECTIVE, REGION, STEP, parse_collective

BWD = "autograd::engine::evaluate_function: "


class Trace:
    """A hand-made event list: add(name, start, end, parent) -> index."""

    def __init__(self) -> None:
        """An empty list."""
        self.events: list[Event] = []

    def add(self, name: str, start: float, end: float, parent: int = -1, seq: int = -1) -> int:
        """Append one event; its index."""
        self.events.append(Event(name, 1, seq, 1, start, end, parent))
        return len(self.events) - 1


def one_step(shift: float = 0.0) -> list[Event]:
    """A 100 us step: block h.0 (forward 10-40, an all-reduce at 20-30), its backward at 50-80 calling an
    all-reduce at 60-70 (the backward of a grad_all_reduce made at 15), an unlinked AccumulateGrad at 80-85,
    the optimizer region at 86-96."""
    t = Trace()
    s = t.add(STEP + "0", 0, 100)
    b = t.add(BLOCK + "h.0", 10, 40, s)
    t.add("tpcompile::grad_all_reduce", 15, 16, b, seq=7)
    c = t.add(COLLECTIVE + "all_reduce @ h.0.attn.c_proj (all_reduce_1) [256 B]", 20 + shift, 30, b)
    t.add("tpcompile::all_reduce", 20 + shift, 30, c, seq=8)
    g = t.add(COLLECTIVE + "grad_all_reduce @ h.0.attn.c_attn (grad_all_reduce_1) [128 B]", 14, 17, b)
    t.events[2] = t.events[2]._replace(parent=g)
    e = t.add(BWD + "GeneratedBackwardFor_tpcompile_grad_all_reduce_defaultBackward", 50, 80, s, seq=7)
    t.add("tpcompile::all_reduce", 60, 70, e)
    t.add(BWD + "torch::autograd::AccumulateGrad", 80, 85, s)
    t.add(REGION + "optimizer", 86, 96, s)
    return t.events


def test_parts_of_a_step_add_up_to_the_step() -> None:
    """Every microsecond of the step lands in exactly one part: blocks, collectives, regions or other."""
    (rec,) = read_steps(one_step(), group_size=2)
    parts = sum(rec.compute.values()) + sum(rec.regions.values()) + sum(c.ms for c in rec.calls) + rec.other_ms
    assert rec.step_ms == pytest.approx(0.1)
    assert parts == pytest.approx(rec.step_ms)
    assert rec.regions == {"optimizer": pytest.approx(0.010)}


def test_backward_collective_is_named_by_its_forward_node() -> None:
    """The all-reduce autograd runs for a grad_all_reduce is that node's backward, in its block, at its bytes."""
    (rec,) = read_steps(one_step(), group_size=2)
    back = [c for c in rec.calls if c.phase == "backward"]
    assert [(c.op, c.module, c.node, c.block, c.bytes) for c in back] == [
        ("all_reduce", "h.0.attn.c_attn", "grad_all_reduce_1", "h.0", 128)]
    assert back[0].ms == pytest.approx(0.010)
    # block compute: forward 30 us minus the 10 us all-reduce (the grad_all_reduce's 3 us stay: it sends nothing),
    # backward 30 us minus its 10 us all-reduce, and the unlinked AccumulateGrad after it (5 us)
    assert rec.compute["h.0"] == pytest.approx((20 + 20 + 5) / 1e3)
    assert [c.op for c in rec.calls if c.phase == "forward"] == ["all_reduce"]


def test_parse_collective_reads_its_own_label() -> None:
    """A collective region's name gives back op, module, node and bytes; other names give None."""
    got = parse_collective(COLLECTIVE + "all_gather @ lm_head (all_gather_3) [4096 B]")
    assert got == {"op": "all_gather", "module": "lm_head", "node": "all_gather_3", "bytes": 4096}
    assert parse_collective(BLOCK + "pre") is None


def test_waiting_is_the_late_peers_arrival() -> None:
    """Rank 1 reaches the all-reduce 6 us after rank 0: rank 0's call waited 6 us, rank 1's none."""
    ranks = [RankProfile(0, (0, 1), read_steps(one_step(0.0), 2)),
             RankProfile(1, (0, 1), read_steps(one_step(6.0), 2))]
    data = build_report(ranks).data
    (h0,) = [b for b in data["blocks"] if b["block"] == "h.0"]
    fwd = next(c for c in h0["collectives"] if c["phase"] == "forward")
    assert fwd["wait_ms"] == pytest.approx(0.006 / 2)  # the mean over the two ranks: 6 us and 0
    assert data["accounted_ms"] + data["other_ms"] == pytest.approx(data["step_ms"])
    assert data["predicted_step_ms"] is None and data["off_terms"] == []


def test_torch_distributed_calls_outside_every_block_are_counted() -> None:
    """A data-parallel all-gather between blocks (FSDP's hooks) is a collective of its own entry, not lost time."""
    t = Trace()
    s = t.add(STEP + "0", 0, 100)
    t.add(BLOCK + "h.0", 10, 40, s)
    t.add("c10d::_allgather_base_", 45, 75, s)
    data = build_report([RankProfile(0, (0,), read_steps(t.events, 1))]).data
    (outside,) = [b for b in data["blocks"] if b["kind"] == "outside"]
    assert [c["op"] for c in outside["collectives"]] == ["c10d::_allgather_base_"]
    assert data["accounted_ms"] == pytest.approx(0.060) and data["other_ms"] == pytest.approx(0.040)
    assert {t["term"]: t["measured_ms"] for t in data["terms"]}["dp_comm"] == pytest.approx(0.030)
