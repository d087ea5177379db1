"""HybridModel: this rank's part of a model trained with tensor x data x pipeline parallelism."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.fx import GraphModule

from tpcompile.errors import TPCompileError
from tpcompile.hybrid.checkpoint import TensorSpec, dcp_state, load_groups, param_layouts
from tpcompile.hybrid.grads import LocalParam, TiedGrads, clip_grad_norm, local_tensor
from tpcompile.hybrid.io import InputLayout
from tpcompile.hybrid.pipeline import Pipeline
from tpcompile.ops import rng
from tpcompile.runtime.input_check import InputCheck
from tpcompile.runtime.loss_scale import LossScaler


class HybridModel:
    """This rank's pipeline stages, tensor-parallel and wrapped by FSDP2 or DDP, and their train step.

    `step(*inputs, target=...)` runs forward and backward over all microbatches of this
    data-parallel rank's batch and returns the loss of the whole global batch (the same on every
    rank); gradients accumulate in `.grad` as with `loss.backward()`, so call the optimizer's
    `zero_grad()` between steps. `parameters()` feeds any torch optimizer; `clip_grad_norm_` clips
    by the global norm; `tpcompile.dcp.save(hm, path)` / `tpcompile.dcp.load(hm, path)` checkpoint it.
    """

    def __init__(self, *, mesh: DeviceMesh, stages: dict[int, GraphModule], wrapped: dict[int, nn.Module],
                 specs: dict[str, TensorSpec], pipeline: Pipeline, layout: InputLayout, ties: TiedGrads,
                 data_parallel: str, schedule: str, guards: tuple[nn.Module, ...] = (),
                 input_check: Optional[InputCheck] = None, scaler: Optional[LossScaler] = None) -> None:
        self.mesh, self.stages, self.wrapped, self.specs = mesh, stages, wrapped, specs
        self.pipeline, self.layout, self.ties = pipeline, layout, ties
        self.data_parallel, self.schedule = data_parallel, schedule
        # the capture's input guards (fixed dims, autocast, torch.export's conditions), run by every rank on the
        # whole batch before any stage does: a rank that fails them fails before its peers wait for it
        self.guards, self.input_check = guards, input_check
        self.scaler = scaler  # float16: the loss scale, and whether the last step overflowed on any rank
        self._accumulating = False  # inside no_sync()
        self._window: Optional[dict] = None  # tied copies' gradients before the accumulation window began
        self.tp_rank, self.tp = mesh["tp"].get_local_rank(), mesh["tp"].size()

    @property
    def stage_indices(self) -> list[int]:
        """The pipeline stages this rank runs."""
        return sorted(self.stages)

    @property
    def num_stages(self) -> int:
        """Pipeline stages in all."""
        return self.pipeline.n_stages

    def local_params(self) -> list[LocalParam]:
        """Every parameter copy this rank holds, with its stage and spec (read after wrapping: FSDP swaps them)."""
        out: list[LocalParam] = []
        for idx in self.stage_indices:
            for name, p in self.stages[idx].named_parameters():
                out.append(LocalParam(idx, p, self.specs[name]))
        return out

    def held_tensors(self) -> Iterator[tuple[torch.Tensor, TensorSpec]]:
        """(tensor, spec) of every parameter and buffer this rank holds, for checkpoints and weights."""
        for idx in self.stage_indices:
            stage = self.stages[idx]
            names = stage.meta["names"]
            for name, t in list(stage.named_parameters()) + list(stage.named_buffers()):
                spec = self.specs.get(names.get(name, name))
                if spec is not None:
                    yield t, spec

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters (its stages' slices and shards), for a torch optimizer."""
        seen: set[int] = set()
        for lp in self.local_params():
            if id(lp.param) not in seen:
                seen.add(id(lp.param))
                yield lp.param

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(the model's name, parameter) of this rank's parameters."""
        seen: set[int] = set()
        for lp in self.local_params():
            if id(lp.param) not in seen:
                seen.add(id(lp.param))
                yield lp.spec.name, lp.param

    def step(self, *inputs: Any, target: Any = None, **kwargs: Any) -> torch.Tensor:
        """Forward and backward of this data-parallel rank's batch, gradients synchronised; the global mean loss.

        Inside `with hm.no_sync():` the gradients accumulate without being summed across data-parallel ranks
        (nor tied copies across stages); the first step after it sums everything accumulated.
        """
        tensors, target = self._inputs(inputs, kwargs, target)
        params = self.local_params()
        if self._window is None:  # a step that starts an accumulation window, or stands alone
            if self.scaler is not None:
                self._check_unscaled(params)
            self._window = self.ties.snapshot(params)  # gradients accumulate over steps until zero_grad()
        if self.scaler is not None:
            self.pipeline.loss_scale = self.scaler.value
        self.pipeline.accumulate = self._accumulating
        # dropout masks by global position: this step's number, and where this dp rank's rows lie in the global
        # batch (the dp ranks' batches in rank order); each microbatch adds its own offset (dp_sync.Stage)
        batch = tensors[0].shape[0] if tensors and tensors[0].dim() else 0
        with rng.step(rng.next_step()), rng.rows(self.mesh["dp"].get_local_rank() * batch,
                                                 chunk_rows=batch // self.pipeline.microbatches):
            mine = self.pipeline.step(tensors, target)
        if not self._accumulating:
            self.ties.sync(self.local_params(), self._window)
            self._window = None
            if self.scaler is not None:  # every rank skips the step (gradients cleared) if any rank overflowed
                self.scaler.unscale_(self.parameters())
                self.scaler.update()
        return self._global_loss(mine)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Steps inside accumulate their gradients with no data-parallel (or tied-copy) sum; the next step sums all."""
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    def _inputs(self, inputs: tuple, kwargs: dict, target: Any) -> tuple[list[torch.Tensor], Any]:
        """The first stage's tensors and the target on this rank's device, checked before any stage runs."""
        if target is None:
            raise TPCompileError("step() needs target=...: the loss is computed from the model's output and the "
                                 "target on the last pipeline stage")
        leaves = self.layout.flat_inputs(inputs, kwargs)
        for guard in self.guards:
            guard(*leaves)
        tensors = [leaves[i].to(self.pipeline.device) for i in self.layout.tensor_positions]
        if isinstance(target, torch.Tensor):
            target = target.to(self.pipeline.device)
        if self.input_check is not None:  # the ranks of a tensor-parallel group must be given the same batch
            self.input_check((*tensors, target))
        return tensors, target

    def _global_loss(self, mine: Optional[torch.Tensor]) -> torch.Tensor:
        """The global batch's loss on every rank, from the last stage's mean over its microbatches."""
        # (the loss is computed in float32 at least: a bfloat16 or float16 output is cast before loss_fn)
        loss = torch.zeros((), dtype=torch.promote_types(self.layout.output_dtype, torch.float32),
                           device=self.pipeline.device)
        if mine is not None:
            loss.copy_(mine)
        pp = self.mesh["pp"]
        if pp.size() > 1:  # the last stage's rank has the loss: every pipeline rank gets it
            owner = (self.num_stages - 1) % pp.size()
            dist.broadcast(loss, src=dist.get_global_rank(pp.get_group(), owner), group=pp.get_group())
        dp = self.mesh["dp"]
        if dp.size() > 1:  # the global batch's loss: the mean of the data-parallel ranks' losses
            dist.all_reduce(loss, group=dp.get_group())
            loss /= dp.size()
        return loss

    @property
    def last_step_skipped(self) -> bool:
        """True when the last float16 step overflowed on some rank: its gradients were cleared on every rank."""
        return self.scaler is not None and self.scaler.found_inf

    def _check_unscaled(self, params: list[LocalParam]) -> None:
        """float16 steps unscale the gradients of their window: refuse gradients left over from an earlier one."""
        left = next((lp.spec.name for lp in params if lp.param.grad is not None), None)
        if left is not None:
            raise TPCompileError(f"mixed_precision='fp16': {left} still holds a gradient from an earlier step(); each "
                                 f"step unscales the gradients it made, so call zero_grad() (or the optimizer's) "
                                 f"between steps, and accumulate inside `with hm.no_sync():` or with microbatches=")

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip all gradients by their global norm (over every stage, TP slice and FSDP shard); that norm."""
        return clip_grad_norm(self.local_params(), self.ties, self.mesh, float(max_norm), float(norm_type),
                              sharded_dp=self.data_parallel == "fsdp")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every local gradient."""
        for p in self.parameters():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def dcp_load_groups(self) -> tuple[list, set[str], Any]:
        """This rank's tensors for tpcompile.dcp.load, every name of the model, and what to run after the load."""
        return load_groups(self)

    def dcp_state(self) -> dict[str, Any]:
        """This rank's tensors as chunks of the full tensors, keyed by the model's names (tpcompile.dcp)."""
        return dcp_state(self.held_tensors(), self.tp_rank, self.tp)

    def dcp_params(self) -> list:
        """Every parameter copy this rank holds with its names and chunk arithmetic (optimizer state, tpcompile.dcp)."""
        return param_layouts(((lp.param, lp.spec) for lp in self.local_params()), self.tp_rank, self.tp)

    def parameter_bytes(self) -> int:
        """Bytes of parameter storage this rank holds now (its shards between steps)."""
        seen: dict[int, torch.Tensor] = {}
        for p in self.parameters():
            t = local_tensor(p)
            seen[id(t)] = t
        return sum(t.numel() * t.element_size() for t in seen.values())

    def __repr__(self) -> str:
        dims = ", ".join(f"{d}={self.mesh[d].size()}" for d in ("dp", "tp", "pp"))
        return (f"HybridModel({dims}, stages {self.stage_indices} of {self.num_stages}, "
                f"{self.data_parallel}, {self.schedule})")

