"""tpcompile: automatic tensor parallelism for PyTorch models, one sharded fx graph per rank."""
from tpcompile.api import ShardedModel, shard
from tpcompile.errors import TPCompileError
from tpcompile.parallelize import parallelize
from tpcompile.passes.propagate import TPCompileWarning
from tpcompile.simulator import simulate, simulate_ranks

__all__ = ["shard", "parallelize", "ShardedModel", "simulate", "simulate_ranks", "TPCompileError",
           "TPCompileWarning"]
__version__ = "0.1.0"
