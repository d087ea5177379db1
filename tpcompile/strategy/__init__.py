"""The strategy planner: a cost model that chooses tp, dp, pp, sequence parallelism, microbatches,
recompute and per-unit split-or-replicate for a model on a cluster (docs/strategy.md)."""
from tpcompile.strategy.calibrate import this_machine
from tpcompile.strategy.cluster import Cluster, load_cluster
from tpcompile.strategy.planner import plan_parallel
from tpcompile.strategy.record import Alternative, Strategy

__all__ = ["Alternative", "Cluster", "Strategy", "load_cluster", "plan_parallel", "this_machine"]
