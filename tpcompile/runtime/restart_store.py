"""torchrun --max-restarts: the process group of each restart attempt gets a key space of its own in torchrun's store.

torchrun (torch >= 2.4, with its default c10d rendezvous and with the static one) keeps one TCPStore
for the whole job: MASTER_PORT is the same in every attempt, and workers use that store directly
(TORCHELASTIC_USE_AGENT_STORE=True). `init_process_group(init_method="env://")` then writes its keys
there with no per-attempt prefix (torch.distributed.rendezvous._create_c10d_store assumes a new store
per retry, which the shared store is not). After a restart the failed attempt's keys are still there:
a rank of the new attempt can read a dead peer's gloo address before the restarted peer overwrites
it, and gloo's connectFullMesh fails with "Connection refused" (or waits for its timeout), depending
on which rank writes first (pytorch/pytorch#135712). On one node all workers restart together and
agree on TORCHELASTIC_RESTART_COUNT, so keys prefixed with it are each attempt's own. Across nodes the
agents' restart counts can differ, so there set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun
(rank 0 then hosts a new store on a new port in every attempt).
"""
from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

__all__ = ["restart_store"]

log = logging.getLogger("tpcompile")


def restart_store(timeout: timedelta) -> Optional[dist.Store]:
    """torchrun's shared store seen through this attempt's prefix on a one-node launch; None where env:// is right."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "TORCHELASTIC_RESTART_COUNT" not in env:
        return None
    if env.get("LOCAL_WORLD_SIZE") != env.get("WORLD_SIZE"):  # several nodes: their restart counts can differ
        if int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0:
            log.warning("torchrun --max-restarts over several nodes shares one TCPStore between attempts, so a "
                        "restart can read the failed attempt's keys and not connect; launch torchrun with "
                        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment")
        return None
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"tpcompile/attempt_{env['TORCHELASTIC_RESTART_COUNT']}", store)
