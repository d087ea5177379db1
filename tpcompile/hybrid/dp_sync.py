"""When a stage's data-parallel gradients are summed: at the end of every step, or only after accumulation steps.

torch.distributed.pipelining runs every microbatch but the last under DDP's `no_sync` (or with FSDP's
gradient sync off) and sums the gradients over the data-parallel group at the end of each schedule
step. Accumulating over several `HybridModel.step` calls (`with hm.no_sync(): hm.step(...)`) should
sum them once, after the last: `Stage` is a PipelineStage whose `accumulate` flag makes the step's
last backward run under `no_sync` too (DDP), and its end-of-step post-backward keep FSDP's
unsharded gradients, accumulated in FSDP's reduce dtype, instead of reduce-scattering them (what
FSDP2's `set_requires_gradient_sync(False)` does in a plain backward). The first step without the
flag sums everything accumulated.
"""
from __future__ import annotations

from typing import Any

from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining import PipelineStage

from tpcompile.ops import rng

__all__ = ["Stage"]


class Stage(PipelineStage):
    """A PipelineStage whose data-parallel gradient sum waits while `accumulate` is set."""

    accumulate: bool = False

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        """The microbatch's forward, its dropout masks at its rows of the batch (tpcompile.ops.rng.chunk)."""
        with rng.chunk(fwd_chunk_id):
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_maybe_with_nosync(self, backward_type: Any, bwd_kwargs: dict, last_backward: bool = False) -> Any:
        """The microbatch's backward; while accumulating, the last one also without DDP's gradient sync."""
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs,
                                                  last_backward=last_backward and not self.accumulate)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        """The end of the step's backward: FSDP's post-backward, reducing only when not accumulating."""
        if not (self.accumulate and isinstance(self.submod, FSDPModule)):
            super().perform_reduce_grad(grad_scale_factor)
            return
        module = self.submod
        module.set_is_last_backward(True)
        module.set_reshard_after_backward(True)
        module.set_requires_gradient_sync(False)  # post_backward keeps the unsharded gradients
        state = fully_shard.state(module)  # type: ignore[attr-defined]
        for each in state._state_ctx.all_states:
            for group in each._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()
