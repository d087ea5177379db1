"""Hybrid parallelism: tensor x data (FSDP2 or DDP) x pipeline parallel on one DeviceMesh (docs/hybrid.md)."""
from tpcompile.hybrid.mesh import init_mesh
from tpcompile.hybrid.model import HybridModel
from tpcompile.hybrid.train import parallelize_train

__all__ = ["HybridModel", "init_mesh", "parallelize_train"]
