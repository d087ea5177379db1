"""The train step: torch.distributed.pipelining stages and schedules over "pp".

Each rank runs its stage modules (one, or several for an interleaved schedule: stages
r, r + pp, r + 2pp, ...) as PipelineStages of the pipeline group. The shapes every stage sends
and receives are computed from the captured graph's symbolic shapes at the microbatch's sizes
and given to PipelineStage, so no stage runs a trial forward to find them; a new input shape
builds a new schedule. The loss of each microbatch is divided by the number of microbatches
before backward (the schedule itself scales nothing), so the gradients are those of the whole
batch's mean loss; the losses themselves are recorded unscaled.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import sympy
import torch
from torch import nn
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.fx import Node

from tpcompile.errors import TPCompileError, TPCompileWarning
from tpcompile.hybrid.dp_sync import Stage
from tpcompile.runtime.failures import lost_peer, translate

Port = tuple[str, Any]  # (name, fake value) of a value a stage receives or sends; no graph reference
SCHEDULES: dict[str, type] = {"1f1b": Schedule1F1B, "interleaved1f1b": ScheduleInterleaved1F1B, "gpipe": ScheduleGPipe}
INTERLEAVE = 2  # stages per rank under an interleaved schedule


def schedule_class(name: str) -> type:
    """The torch schedule called `name` ('1F1B', 'Interleaved1F1B', 'GPipe'; case and '_' ignored)."""
    key = str(name).lower().replace("_", "").replace("-", "")
    if key not in SCHEDULES:
        raise TPCompileError(f"schedule {name!r} is not one of 1F1B, Interleaved1F1B, GPipe; pass one of those")
    return SCHEDULES[key]


def stages_per_rank(cls: type, pp: int) -> int:
    """How many stages each pipeline rank runs: INTERLEAVE for a multi-stage schedule with pp > 1, else 1."""
    return INTERLEAVE if issubclass(cls, PipelineScheduleMulti) and pp > 1 else 1


def ports(nodes: list[Node]) -> list[Port]:
    """(name, fake value) of captured values: what the pipeline needs of them, without the graph."""
    return [(n.name, n.meta.get("val")) for n in nodes]


def _bindings(inputs: list[Port], values: list[torch.Tensor]) -> dict:
    """Symbol -> size, from the captured inputs' symbolic shapes and one microbatch's tensors."""
    out: dict = {}
    for (_, val), t in zip(inputs, values):
        if not isinstance(val, torch.Tensor) or not isinstance(t, torch.Tensor) or val.dim() != t.dim():
            continue
        for s, n in zip(val.shape, t.shape):
            if isinstance(s, torch.SymInt) and isinstance(s.node.expr, sympy.Symbol):
                out[s.node.expr] = sympy.Integer(int(n))
    return out


def _meta(port: Port, sizes: dict) -> torch.Tensor:
    """An empty meta tensor shaped like the value at the given sizes (floats carry gradients)."""
    name, val = port
    if not isinstance(val, torch.Tensor):
        raise TPCompileError(f"{name} passes from one pipeline stage to another but is a {type(val).__name__}, not a "
                             f"tensor; stages exchange tensors only: make it a tensor, or compute it in the stage "
                             f"that uses it")
    shape = []
    for s in val.shape:
        if isinstance(s, torch.SymInt):
            expr = sympy.sympify(s.node.expr).xreplace(sizes)
            if not expr.is_number:
                raise TPCompileError(f"the size {s.node.expr} of {name} does not follow from the inputs' "
                                     f"sizes; pass inputs whose every dimension was an input of the capture")
            shape.append(int(expr))
        else:
            shape.append(int(s))
    return torch.empty(shape, dtype=val.dtype, device="meta", requires_grad=val.dtype.is_floating_point)


class Pipeline:
    """Runs a train step of this rank's stages under a torch pipelining schedule."""

    def __init__(self, modules: list[nn.Module], indices: list[int], n_stages: int,
                 io: list[tuple[list[Port], list[Port]]], group: Any, device: torch.device, cls: type,
                 microbatches: int, loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
        """`modules[i]` runs stage `indices[i]` of `n_stages`; `io[s]` is stage s's (inputs, outputs)."""
        self.modules, self.indices, self.n_stages, self.io = modules, indices, n_stages, io
        self.group, self.device, self.microbatches, self.loss_fn = group, device, microbatches, loss_fn
        if issubclass(cls, Schedule1F1B) and microbatches < n_stages:
            warnings.warn(f"schedule 1F1B needs at least as many microbatches as stages ({n_stages}), got "
                          f"{microbatches}; running GPipe instead (the same order of work for so few microbatches)",
                          TPCompileWarning, stacklevel=3)
            cls = ScheduleGPipe
        self.cls = cls
        self.first, self.last = 0 in indices, n_stages - 1 in indices
        self._built: dict[tuple, Any] = {}
        self.losses: list[torch.Tensor] = []
        self.loss_scale = 1.0  # float16: backward runs on the loss times this (runtime/loss_scale.py)
        self._stages: dict[tuple, list[Stage]] = {}
        self.accumulate = False  # the step's data-parallel gradient sum waits (dp_sync.py)

    def _schedule(self, inputs: list[torch.Tensor]) -> Any:
        """The schedule for microbatches of these inputs' shapes (built once per shape)."""
        key = tuple(tuple(t.shape) for t in inputs)
        if key not in self._built:
            micro = [t.tensor_split(self.microbatches)[0] for t in inputs]
            sizes = _bindings(self.io[0][0], micro)
            stages = []
            for mod, idx in zip(self.modules, self.indices):
                ins, outs = self.io[idx]
                stages.append(Stage(mod, idx, self.n_stages, self.device,
                                            input_args=tuple(_meta(n, sizes) for n in ins),
                                            output_args=tuple(_meta(n, sizes) for n in outs), group=self.group))
            self._stages[key] = stages
            one = stages[0] if issubclass(self.cls, PipelineScheduleSingle) else stages
            try:
                self._built[key] = self.cls(one, n_microbatches=self.microbatches, loss_fn=self._loss,
                                            scale_grads=False)
            except ValueError as e:  # torch's own condition on microbatches and stages
                raise TPCompileError(f"schedule {self.cls.__name__} over {self.n_stages} stages cannot run "
                                     f"{self.microbatches} microbatches: {e}; change microbatches or the "
                                     f"schedule") from e
        return self._built[key]

    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        loss = self.loss_fn(output, target)
        self.losses.append(loss.detach())
        return loss * (self.loss_scale / self.microbatches)

    def step(self, inputs: list[torch.Tensor], target: Any) -> Optional[torch.Tensor]:
        """Forward and backward over all microbatches; the mean microbatch loss on the last stage's rank."""
        batch = inputs[0].shape[0] if inputs and inputs[0].dim() else 0
        if batch % self.microbatches:
            raise TPCompileError(f"the batch of {batch} does not split into {self.microbatches} microbatches; pass a "
                                 f"batch (per data-parallel rank) divisible by microbatches={self.microbatches}")
        schedule = self._schedule(inputs)
        for stage in self._stages[tuple(tuple(t.shape) for t in inputs)]:
            stage.accumulate = self.accumulate
        self.losses = []
        args = tuple(inputs) if self.first else ()
        try:
            if self.last:
                schedule.step(*args, target=target, losses=[])
                return torch.stack(self.losses).mean()
            schedule.step(*args)
        except Exception as e:  # noqa: BLE001  pipelining wraps a stage's own error: raise that one
            own = _own_error(e)
            if own is e and any(lost_peer(c) for c in _chain(e)):  # a peer died or stalled in a send or receive
                own = translate(next(c for c in _chain(e) if lost_peer(c)), group=self.group,
                                where=f"the pipeline's sends and receives of stage{'s' if len(self.indices) > 1 else ''}"
                                      f" {', '.join(map(str, self.indices))} of {self.n_stages}")
            if own is e:
                raise
            raise own from e
        return None


def _chain(error: BaseException) -> list[BaseException]:
    """The error and the ones it was raised from, innermost last."""
    out: list[BaseException] = []
    e: Optional[BaseException] = error
    while e is not None and all(e is not c for c in out):
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def _own_error(error: BaseException) -> BaseException:
    """The TPCompileError that a pipelining error wraps ("[Stage 0] failed to run forward"), else the error itself."""
    return next((e for e in _chain(error) if isinstance(e, TPCompileError)), error)
