"""Hybrid parallelism: tensor x data (FSDP2 or DDP) x pipeline parallel on one DeviceMesh (docs/hybrid.md)."""
from typing import Any

from tpcompile.hybrid.mesh import init_mesh
from tpcompile.hybrid.train import parallelize_train

__all__ = ["HybridModel", "init_mesh", "parallelize_train"]


def __getattr__(name: str) -> Any:
    # HybridModel's module imports torch's pipelining and DTensor packages (seconds): only when asked for
    if name == "HybridModel":
        from tpcompile.hybrid.model import HybridModel
        return HybridModel
    raise AttributeError(f"module 'tpcompile.hybrid' has no attribute {name!r}")
