"""init_mesh(): one DeviceMesh ("pp", "dp", "tp") over every process, tensor parallelism innermost."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tpcompile.errors import TPCompileError
from tpcompile.runtime.torchrun import init_from_env

__all__ = ["MESH_DIMS", "init_mesh", "mesh_device"]

MESH_DIMS = ("pp", "dp", "tp")


def _degree(name: str, value: object) -> int:
    """A parallel degree: an int >= 1 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TPCompileError(f"init_mesh: {name} must be an int >= 1, got {value!r}; e.g. init_mesh(dp=2, tp=2, pp=2)")
    return value


def init_mesh(*, dp: int = 1, tp: int = 1, pp: int = 1) -> DeviceMesh:
    """A DeviceMesh of shape (pp, dp, tp) named ("pp", "dp", "tp") over all dp*tp*pp processes.

    tp is the innermost dim, so the ranks of one tensor-parallel group are consecutive (one
    node under torchrun), dp next, pp outermost. Starts the default process group from
    torchrun's environment when none is running (NCCL on CUDA, else gloo); a plain `python`
    process with dp = tp = pp = 1 becomes a one-process group.
    """
    dp, tp, pp = _degree("dp", dp), _degree("tp", tp), _degree("pp", pp)
    size = dp * tp * pp
    if not dist.is_initialized():
        launched = "RANK" in os.environ or "WORLD_SIZE" in os.environ
        if not launched and size != 1:
            raise TPCompileError(f"init_mesh(dp={dp}, tp={tp}, pp={pp}) needs {size} processes but none "
                                 f"were launched; start with torchrun --nproc-per-node {size}")
        init_from_env(standalone=not launched)
    world = dist.get_world_size()
    if world != size:
        raise TPCompileError(f"init_mesh(dp={dp}, tp={tp}, pp={pp}) needs dp*tp*pp = {size} processes but the "
                             f"process group has {world}; launch {size} processes or change the degrees")
    return init_device_mesh(mesh_device().type, (pp, dp, tp), mesh_dim_names=MESH_DIMS)


def mesh_device() -> torch.device:
    """This process's device: cuda:LOCAL_RANK on NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return torch.device("cpu")
