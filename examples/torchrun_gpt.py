"""Run the bundled GPT tensor-parallel under torchrun:

    torchrun --nproc-per-node 2 examples/torchrun_gpt.py

Every process shards the model itself and keeps only its own rank's weights; on GPUs the same
command runs on NCCL, each rank on cuda:LOCAL_RANK.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import tpcompile
from tpcompile.cli.script import run_script
from tpcompile.models import build
from tpcompile.runtime import init_from_env, shutdown


def main() -> None:
    """Parallelize, run this rank, compare with the unsharded model, report from rank 0."""
    owned = not dist.is_initialized()
    rank, world = init_from_env()
    model = build("gpt")
    local = tpcompile.parallelize(model, example_inputs=model.example_inputs())
    device = next(local.parameters()).device
    idx = torch.randint(0, 256, (3, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (local(idx.to(device)).cpu() - model(idx)).abs().max()
    worst = diff.to(device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if rank == 0:
        params = sum(p.numel() for p in local.parameters())
        print(f"world size {world} on {dist.get_backend()}: rank 0 holds {params:,} of "
              f"{sum(p.numel() for p in model.parameters()):,} parameters; max |diff| {worst.item():.2e}")
        print("OK" if worst.item() <= 1e-5 else "MISMATCH")
    shutdown(destroy=owned)  # barrier: no rank tears the group down while another still uses it


if __name__ == "__main__":
    raise SystemExit(run_script(main))  # a user error: one line from rank 0, exit 2
