"""Property: every generated model shards to the original's numerics on every rank, or raises TPCompileError.

The short run is part of the default suite (derandomized, so CI sees the same cases every time).
The long run (`make fuzz`, marked slow) draws fresh random cases and prints a summary by outcome;
TPCOMPILE_FUZZ_EXAMPLES sets its number of cases (default 2000).
"""
from __future__ import annotations

import collections
import os
import time

import pytest
from fuzz_cases import COMM, describe_failure, run_case, said
from fuzz_models import FuzzConfig, fuzz_configs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# torch.export is most of a case's time, so each captured model is sharded at several world sizes:
# every one of 1-8 in the short run, 5 distinct random ones in the long run (more models per minute).
ALL_WORLDS = list(range(1, 9))
LONG_WORLDS = 5
SHORT_CASES = 120
SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
some_world_sizes = st.lists(st.integers(1, 8), min_size=LONG_WORLDS, max_size=LONG_WORLDS, unique=True)


def _run(cfg: FuzzConfig, sizes: list[int], counts: collections.Counter, failures: list[str]) -> None:
    """Run one model at its world sizes, counting outcomes (and, as "comm <setting>", the communication
    passes they ran with) and collecting failure reports."""
    for ws, outcome in run_case(cfg, sizes).items():
        counts[outcome.kind] += 1
        counts[f"comm {cfg.comm}"] += 1
        report = describe_failure(cfg, ws, outcome)
        if report:
            failures.append(report)


def _summary(counts: collections.Counter, models: int, seconds: float) -> str:
    kinds = ("sharded", "partly_replicated", "error", "mismatch", "crash")
    total = sum(counts[k] for k in kinds)
    comm = ", ".join(f"{k} {counts['comm ' + k]}" for k in COMM)
    return (f"fuzz: {total} cases ({models} models) in {seconds:.0f} s: "
            f"{', '.join(f'{k} {counts[k]}' for k in kinds)}; comm passes: {comm}")


def test_fuzz_short() -> None:
    """120 derandomized cases (15 models x world sizes 1-8): equal numerics or TPCompileError."""
    counts: collections.Counter = collections.Counter()
    failures: list[str] = []

    @settings(max_examples=SHORT_CASES // len(ALL_WORLDS), derandomize=True, database=None, deadline=None,
              suppress_health_check=SUPPRESS)
    @given(cfg=fuzz_configs())
    def check(cfg: FuzzConfig) -> None:
        before = len(failures)
        _run(cfg, ALL_WORLDS, counts, failures)
        assert len(failures) == before, "\n".join(failures[before:])  # raising lets hypothesis shrink the case

    start = time.perf_counter()
    check()
    summary = _summary(counts, SHORT_CASES // len(ALL_WORLDS), time.perf_counter() - start)
    print(summary)
    assert sum(counts[f"comm {k}"] for k in COMM) == SHORT_CASES, summary
    # The property is only worth something if the cases really split: fully split ones must be common.
    assert counts["sharded"] >= SHORT_CASES // 10, summary
    assert all(counts[f"comm {k}"] for k in COMM), summary  # every setting of the comm passes is run


def test_an_error_reporting_a_bug_of_its_own_fails_the_property() -> None:
    """A TPCompileError is an allowed outcome unless it says it is a tpcompile bug (a rank graph the verifier
    found malformed, say): that one fails, like a crash."""
    from tpcompile import TPCompileError
    bug = TPCompileError("rank 0's graph is malformed: x used before defined; this is a tpcompile bug; please "
                         "report it with the model")
    assert said(bug).failed and said(bug).kind == "crash"
    refusal = TPCompileError("input 'x' has size 13 in dim 1, but the capture fixed that dim at 8")
    assert not said(refusal).failed and said(refusal).kind == "error"


@pytest.mark.slow
def test_fuzz_long() -> None:
    """TPCOMPILE_FUZZ_EXAMPLES random cases (default 2000); every failure is collected, then reported."""
    cases = int(os.environ.get("TPCOMPILE_FUZZ_EXAMPLES", "2000"))
    counts: collections.Counter = collections.Counter()
    failures: list[str] = []

    models = -(-cases // LONG_WORLDS)
    start = time.perf_counter()

    @settings(max_examples=models, database=None, deadline=None, suppress_health_check=SUPPRESS)
    @given(cfg=fuzz_configs(), sizes=some_world_sizes)
    def check(cfg: FuzzConfig, sizes: list[int]) -> None:
        _run(cfg, sizes, counts, failures)  # keep going: one run reports every failing case
        done = sum(counts[f"comm {k}"] for k in COMM)
        if done % 250 < LONG_WORLDS:  # a progress line about every 250 cases
            print(f"{done} cases, {len(failures)} failing, {time.perf_counter() - start:.0f} s", flush=True)

    check()
    summary = _summary(counts, models, time.perf_counter() - start)
    print("\n" + "\n".join(failures) + "\n" + summary if failures else "\n" + summary)
    assert not failures, f"{len(failures)} failing cases; {summary}"
