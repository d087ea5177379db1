"""Where the benchmark's ranks run: gloo on the CPU, or NCCL with one GPU per rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tpcompile import TPCompileError

__all__ = ["BACKENDS", "choose_backend", "describe_device", "rank_device", "synchronize"]

BACKENDS = ("auto", "gloo", "nccl")


def choose_backend(requested: str, world_size: int) -> str:
    """'gloo' or 'nccl' for `--backend requested`: auto takes NCCL only when every rank gets its own GPU."""
    if requested not in BACKENDS:
        raise TPCompileError(f"--backend {requested!r} is unknown; choose from {', '.join(BACKENDS)}")
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "auto":
        return "nccl" if found >= world_size else "gloo"
    if requested == "nccl" and found < world_size:
        raise TPCompileError(f"--backend nccl needs {world_size} CUDA devices (one per rank) but found {found}"
                             f" (torch.cuda.is_available() is {torch.cuda.is_available()}); run with"
                             f" --backend gloo, or a smaller --world-size")
    return requested


def describe_device(backend: str, world_size: int) -> str:
    """'2 x NVIDIA H200 on nccl' or 'CPU, gloo', for the report's header."""
    if backend != "nccl":
        return f"CPU, {backend}"
    names = [torch.cuda.get_device_name(r % torch.cuda.device_count()) for r in range(world_size)]
    shown = f"{world_size} x {names[0]}" if len(set(names)) == 1 else ", ".join(names)
    return f"{shown} on nccl"


def rank_device() -> torch.device:
    """This rank's device: its current GPU under NCCL (launch set it to cuda:rank), else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so a clock read after it counts that work (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
