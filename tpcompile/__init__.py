"""tpcompile: automatic tensor parallelism for PyTorch models, one sharded fx graph per rank."""
from tpcompile.api import ShardedModel, shard
from tpcompile.errors import TPCompileError, TPCompileWarning
from tpcompile.generate import shard_generation  # noqa: F401  (docs/generate.md)
from tpcompile.hybrid import init_mesh, parallelize_train  # noqa: F401  (docs/hybrid.md)
from tpcompile.runtime.parallelize import parallelize
from tpcompile.runtime.simulator import simulate, simulate_ranks
from tpcompile.strategy import plan_parallel  # noqa: F401  (docs/strategy.md)

__all__ = ["shard", "parallelize", "ShardedModel", "simulate", "simulate_ranks", "TPCompileError",
           "TPCompileWarning"]
__version__ = "0.1.0"
