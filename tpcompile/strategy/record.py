"""`Strategy`: the chosen layout, what the cost model predicts for it, and the alternatives it beat.

`Strategy.mesh` and `Strategy.train_kwargs` are what the hybrid runtime takes
(`parallelize_train(model, init_mesh(**s.mesh), loss_fn=..., **s.train_kwargs)`, or
`s.parallelize_train(model, loss_fn=...)`); `.table()` is the text the CLI prints and
`.to_dict()` the object `tpcompile strategy --json` prints.
"""
from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from tpcompile.strategy.cluster import Cluster
from tpcompile.strategy.cost import Estimate
from tpcompile.strategy.decisions import Decision, plan_overrides

PART_WORDS = {
    "compute": "more compute per GPU",
    "tp_comm": "more tensor-parallel communication",
    "pp_comm": "more pipeline sends",
    "overhead": "more per-microbatch overhead",
    "imbalance": "unbalanced pipeline stages",
    "bubble": "a larger pipeline bubble",
    "dp_comm": "more exposed data-parallel gradient sync",
    "optimizer": "a larger optimizer step per GPU",
}


@dataclass(frozen=True)
class Alternative:
    """A layout the planner priced and did not choose."""

    tp: int
    dp: int
    pp: int
    microbatches: int
    recompute: bool
    sequence_parallel: bool
    data_parallel: str
    predicted_step_s: float
    memory_per_gpu_bytes: float
    fits: bool
    why_lost: str


@dataclass
class Strategy:
    """The parallel layout plan_parallel chose, with its predictions and the runner-ups."""

    tp: int
    dp: int
    pp: int
    sequence_parallel: bool
    microbatches: int
    recompute: bool
    data_parallel: str  # "fsdp" | "ddp"
    micro_batch_size: int
    global_batch: int
    seq_len: int
    predicted_step_s: float
    memory_per_gpu_bytes: float
    comm_per_step: dict[str, float]  # bytes sent per GPU and step, by mesh dim ("tp", "dp", "pp")
    time_breakdown: dict[str, float]
    memory_breakdown: dict[str, float]
    decisions: list[Decision]  # per unit: split or replicated, and why
    stages: list[tuple[str, str]]  # first and last block of each pipeline stage
    alternatives: list[Alternative]
    cluster: Cluster
    model: str
    training: bool = True
    planning_s: float = 0.0
    capture_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def mesh(self) -> dict[str, int]:
        """`tpcompile.init_mesh(**strategy.mesh)`."""
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp}

    @property
    def plan(self) -> dict[str, str]:
        """tpcompile plan= entries for the units the cost model keeps whole."""
        return plan_overrides(self.decisions)

    @property
    def tokens_per_s(self) -> float:
        """Predicted training throughput of the whole cluster."""
        return self.global_batch * self.seq_len / self.predicted_step_s

    @property
    def mixed_precision(self) -> Optional[str]:
        """The runtime's policy the prices assume: the cluster's compute dtype, float32 weights, state and gradients."""
        return None if self.cluster.dtype == "fp32" else self.cluster.dtype

    @property
    def train_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `tpcompile.parallelize_train` for this layout (those the installed runtime takes)."""
        kwargs: dict[str, Any] = {"microbatches": self.microbatches, "data_parallel": self.data_parallel,
                                  "sequence_parallel": self.sequence_parallel,
                                  "mixed_precision": self.mixed_precision}
        if self.plan:
            kwargs["plan"] = self.plan
        accepted = _runtime_parameters()
        for name in ("recompute", "activation_checkpointing"):
            if name in accepted:
                kwargs[name] = self.recompute
        return {k: v for k, v in kwargs.items() if not accepted or k in accepted}

    def parallelize_train(self, model: Any, **kwargs: Any) -> Any:
        """`tpcompile.parallelize_train(model, tpcompile.init_mesh(**self.mesh), **self.train_kwargs, **kwargs)`."""
        import tpcompile
        return tpcompile.parallelize_train(model, tpcompile.init_mesh(**self.mesh), **{**self.train_kwargs, **kwargs})

    def to_dict(self) -> dict[str, Any]:
        """Everything as JSON-ready values (the `tpcompile strategy --json` object)."""
        return {
            "tp": self.tp, "dp": self.dp, "pp": self.pp, "microbatches": self.microbatches,
            "predicted_step_s": self.predicted_step_s, "memory_per_gpu_bytes": self.memory_per_gpu_bytes,
            "sequence_parallel": self.sequence_parallel, "recompute": self.recompute,
            "data_parallel": self.data_parallel, "mixed_precision": self.mixed_precision,
            "micro_batch_size": self.micro_batch_size,
            "global_batch": self.global_batch, "seq_len": self.seq_len,
            "tokens_per_s": self.tokens_per_s, "tokens_per_s_per_gpu": self.tokens_per_s / self.cluster.gpus,
            "comm_per_step_bytes": self.comm_per_step, "time_breakdown_s": self.time_breakdown,
            "memory_breakdown_bytes": self.memory_breakdown, "stages": [list(s) for s in self.stages],
            "decisions": [{"unit": d.unit, "split": d.split, "why": d.why} for d in self.decisions],
            "plan": self.plan, "alternatives": [asdict(a) for a in self.alternatives],
            "training": self.training, "model": self.model, "cluster": {k: v for k, v in asdict(self.cluster).items()},
            "planning_s": self.planning_s, "capture_s": self.capture_s, "notes": list(self.notes),
        }

    def table(self, top: int = 5) -> str:
        """The choice and the best few alternatives side by side, with time, memory and why each lost."""
        from tpcompile.strategy.table import render
        return render(self, top)

    def __str__(self) -> str:
        return self.table()


def _runtime_parameters() -> set[str]:
    """Keyword names of tpcompile.parallelize_train, when the hybrid runtime is installed."""
    try:
        import tpcompile
        fn = getattr(tpcompile, "parallelize_train", None)
        return set(inspect.signature(fn).parameters) if fn is not None else set()
    except (ImportError, TypeError, ValueError):
        return set()


def why_lost(alt: Estimate, best: Estimate, usable: float) -> str:
    """One phrase: why `alt` is not the choice."""
    if not alt.fits:
        return f"does not fit: needs {alt.memory / 1e9:.1f} GB per GPU of {usable / 1e9:.1f} GB usable"
    if alt.idle_tp and not best.idle_tp:
        return (f"its tensor parallelism splits nothing: each of the {alt.layout.tp} tp ranks would repeat the "
                f"others' work")
    from tpcompile.strategy.quantities import format_seconds
    diffs = {k: alt.time.get(k, 0.0) - best.time.get(k, 0.0) for k in PART_WORDS}
    part = max(diffs, key=lambda k: diffs[k])
    slower = alt.step_s / best.step_s - 1
    if slower <= 1e-9:
        return "as fast; the choice needs less memory" if alt.memory > best.memory else "as fast"
    return f"{slower:.0%} slower: {PART_WORDS[part]} (+{format_seconds(diffs[part])} per step)"


def alternative(est: Estimate, best: Estimate, usable: float) -> Alternative:
    """An Alternative row from an estimate."""
    lay = est.layout
    return Alternative(lay.tp, lay.dp, lay.pp, lay.microbatches, lay.recompute, lay.sequence_parallel,
                       lay.data_parallel, est.step_s, est.memory, est.fits, why_lost(est, best, usable))


def stage_names(est: Estimate, names: list[str]) -> list[tuple[str, str]]:
    """(first block, last block) of each stage."""
    return [(names[i], names[j - 1]) for i, j in est.stages]


def build(best: Estimate, others: list[Estimate], decisions: list[Decision], cluster: Cluster, model: str,
          names: list[str], global_batch: int, seq_len: int, training: bool,
          notes: Optional[list[str]] = None) -> Strategy:
    """The Strategy record of a search result."""
    lay = best.layout
    return Strategy(lay.tp, lay.dp, lay.pp, lay.sequence_parallel, lay.microbatches, lay.recompute,
                    lay.data_parallel, best.micro_batch, global_batch, seq_len, best.step_s, best.memory,
                    dict(best.comm), dict(best.time), dict(best.memory_parts), list(decisions),
                    stage_names(best, names), [alternative(e, best, cluster.usable_memory) for e in others],
                    cluster, model, training, notes=list(notes or []))
