"""Loss scaling for float16 training whose decision to skip a step is the same on every rank.

float16 gradients underflow unless the loss is scaled up before backward; a scale too large makes
some gradient overflow to inf, and that step must be skipped. Under tensor, data and pipeline
parallelism each rank sees only its own gradients, so an overflow on one rank must skip the step
on all of them (or the replicas drift apart): the found-inf flag is summed (MAX) over the whole
group before anyone decides. The scale then backs off, or grows after `growth_interval` good steps,
alike everywhere (torch.amp.GradScaler's rule, on every rank from the same flags).

    scaler = LossScaler()
    scaler.scale(loss).backward()
    if scaler.unscale_(model.parameters()):   # False on every rank when any rank overflowed
        optimizer.step()                      # (the gradients were set to None then: step is a no-op too)
    scaler.update()
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist

from tpcompile.errors import TPCompileError

__all__ = ["LossScaler"]


def _local(t: torch.Tensor) -> torch.Tensor:
    """A rank's own storage of a plain tensor or an FSDP DTensor."""
    return t.to_local() if hasattr(t, "to_local") else t


class LossScaler:
    """Dynamic loss scale with an overflow flag agreed over `group` (default: every process)."""

    def __init__(self, *, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, group: Any = None) -> None:
        if not init_scale > 0 or not growth_factor > 1 or not 0 < backoff_factor < 1 or growth_interval < 1:
            raise TPCompileError(f"LossScaler(init_scale={init_scale}, growth_factor={growth_factor}, backoff_factor="
                                 f"{backoff_factor}, growth_interval={growth_interval}): the scale must be > 0, "
                                 f"growth > 1, 0 < backoff < 1 and the interval >= 1")
        self.value, self.growth, self.backoff, self.interval = float(init_scale), growth_factor, backoff_factor, \
            growth_interval
        self.group, self.good_steps, self.skipped = group, 0, 0
        self.found_inf = False  # the last unscale_'s verdict, the same on every rank

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the current scale (call backward on this)."""
        return loss * self.value

    def unscale_(self, params: Iterable[torch.Tensor]) -> bool:
        """Divide every gradient by the scale; True when all are finite on every rank, else clear them all."""
        params = list(params)
        grads = [p.grad for p in params if p.grad is not None]
        device = _local(grads[0]).device if grads else torch.device("cpu")
        bad = torch.zeros((), dtype=torch.float32, device=device)
        for g in grads:
            local = _local(g)
            local.mul_(1.0 / self.value)
            bad = torch.maximum(bad, (~torch.isfinite(local)).any().to(torch.float32))
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            if dist.get_backend(self.group) == "nccl" and bad.device.type != "cuda":
                bad = bad.cuda()
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.group)
        self.found_inf = bool(bad.item())
        if self.found_inf:
            for p in params:
                p.grad = None
        return not self.found_inf

    def update(self) -> None:
        """Back off after an overflow, grow after `growth_interval` steps without one."""
        if self.found_inf:
            self.value *= self.backoff
            self.good_steps, self.skipped = 0, self.skipped + 1
        else:
            self.good_steps += 1
            if self.good_steps % self.interval == 0:
                self.value *= self.growth

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the scale and the step counts."""
        return {"scale": self.value, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state_dict()."""
        self.value, self.good_steps, self.skipped = float(state["scale"]), int(state["good_steps"]), \
            int(state["skipped"])
