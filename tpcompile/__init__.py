"""tpcompile: automatic tensor parallelism for PyTorch models, one sharded fx graph per rank."""
from tpcompile import logs as _logs  # noqa: F401  every record of the "tpcompile" logger carries its rank
from tpcompile.api import ShardedModel, shard
from tpcompile.passes.comm_options import CommOptions
from tpcompile.errors import TPCompileError, TPCompileWarning
from tpcompile.generate import shard_generation
from tpcompile.hybrid import init_mesh, parallelize_train
from tpcompile.runtime.gradient_check import check_gradients
from tpcompile.runtime.parallelize import parallelize
from tpcompile.runtime.profiler import profile
from tpcompile.runtime.simulator import simulate, simulate_ranks
from tpcompile.strategy import plan_parallel

__all__ = ["shard", "parallelize", "ShardedModel", "simulate", "simulate_ranks", "TPCompileError",
           "TPCompileWarning", "shard_generation", "init_mesh", "parallelize_train", "plan_parallel", "dcp",
           "CommOptions", "check_gradients", "profile"]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """`tpcompile.dcp` without importing it first (it loads torch.distributed.checkpoint)."""
    if name == "dcp":
        import importlib
        return importlib.import_module("tpcompile.dcp")
    raise AttributeError(f"module 'tpcompile' has no attribute {name!r}")
