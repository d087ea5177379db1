"""tpcompile.dcp.save / load: the whole training state in one checkpoint, loadable at any layout and world size.

A checkpoint directory holds, as torch.distributed.checkpoint tensors, the weights (dcp.py), each
parameter's optimizer state laid out like the parameter (optim_state.py) and every rank's torch RNG
state (rng_state.py); and, as JSON written by the first rank (record.py), the step, the user's
`extra`, the optimizer's class, param_groups hyperparameters and which state each parameter has,
tpcompile's dropout RNG state and a float16 loss scaler's state. The order of a save: the record,
then every rank's tensors, then the `.complete` marker, then a barrier; so a checkpoint is complete
when save() returns on any rank, and one whose save was cut short is never loaded.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist

from tpcompile.checkpoint.dcp import RankChunks, rank_state, read, weight_groups, write
from tpcompile.checkpoint.dcp_checks import OPTIM_PREFIX, RNG_PREFIX, Want, agree
from tpcompile.checkpoint.layouts import param_layouts
from tpcompile.checkpoint.optim_state import load_targets as optimizer_targets
from tpcompile.checkpoint.optim_state import merge_manifests, optimizer_values
from tpcompile.checkpoint.record import check_json, mark_complete, start_record
from tpcompile.checkpoint.rng_state import dropout_state, restore_dropout, rng_values
from tpcompile.checkpoint.rng_state import load_targets as rng_targets
from tpcompile.errors import TPCompileError

__all__ = ["load", "save"]

Path = Union[str, os.PathLike]


def _where(group: Any, no_dist: bool) -> tuple[int, int, bool]:
    """(this rank, the world size, whether to run without a process group)."""
    if no_dist or not (dist.is_available() and dist.is_initialized()):
        return 0, 1, True
    return dist.get_rank(group), dist.get_world_size(group), False


def _check_step(step: Any) -> None:
    """Raise unless `step` is None or an int >= 0."""
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise TPCompileError(f"tpcompile.dcp.save: step must be an int >= 0 (the optimizer steps done), got {step!r}")


def _no_clash(state: dict[str, Any]) -> None:
    """Raise when a model tensor's name falls in the names the training state uses."""
    clash = next((n for n in state if n.startswith((OPTIM_PREFIX, RNG_PREFIX))), None)
    if clash is not None:
        raise TPCompileError(f"the model has a tensor named {clash!r}, which tpcompile.dcp uses for training state "
                             f"({OPTIM_PREFIX}*, {RNG_PREFIX}*); rename the module that holds it")


def _scaler(model: Any) -> Any:
    """The model's float16 loss scaler (a HybridModel's, or a LossScaler set as model.scaler), or None."""
    from tpcompile.runtime.loss_scale import LossScaler
    scaler = getattr(model, "scaler", None)
    return scaler if isinstance(scaler, LossScaler) else None


def _gather(value: Any, group: Any, no_dist: bool) -> list[Any]:
    """Every rank's value (this one's alone without a process group)."""
    if no_dist:
        return [value]
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, value, group=group)
    return every


def save(model: Any, path: Path, *, optimizer: Optional[torch.optim.Optimizer] = None, step: Optional[int] = None,
         extra: Any = None, sharded: Any = None, rank: Optional[int] = None, group: Any = None) -> None:
    """Write the model's weights and, when given, its optimizer's state, the step and `extra` into `path`.

    Call it on every rank (a HybridModel, a parallelize rank module, or a plain module in one process).
    `extra` is JSON data (written as JSON, never pickled). With `optimizer` or `step` the RNG states
    are saved too (the whole training state); without, the weights alone. It returns once the
    checkpoint is complete.
    """
    path = str(path)
    me, world, no_dist = _where(group, False)
    training = optimizer is not None or step is not None  # else the weights alone, as they always were
    state: dict[str, Any] = {}
    manifest, problem = None, ""
    try:  # a rank that finds a problem says so to all, so that none waits in a collective it left
        _check_step(step)
        check_json(extra, "extra")
        state = rank_state(model, sharded, rank)
        _no_clash(state)
        if optimizer is not None:
            tensors, manifest = optimizer_values(optimizer, param_layouts(model, sharded, rank), RankChunks.of)
            state.update(tensors)
        if training:
            state.update(rng_values(me, world, RankChunks.of))
    except TPCompileError as e:
        problem = str(e)
    agree(problem, group, no_dist)
    manifests = _gather(manifest, group, no_dist)
    if me == 0:
        scaler = _scaler(model)
        record = {"step": step, "extra": extra, "world_size": world, "optimizer": merge_manifests(manifests),
                  "dropout_rng": dropout_state() if training else None,
                  "loss_scaler": scaler.state_dict() if scaler is not None and training else None}
        try:
            start_record(path, record)
        except OSError as e:
            problem = (f"could not write checkpoint {path!r}: rank {me}: {type(e).__name__}: {e}; check that the "
                       f"directory can be created and written (a path, permissions, free space)")
    agree(problem, group, no_dist)  # no rank starts writing tensors into a directory the first rank could not
    write(state, path, group=group, no_dist=no_dist)
    if me == 0:
        mark_complete(path)
    if not no_dist:
        dist.barrier(group=group)


def load(model: Any, path: Path, *, optimizer: Optional[torch.optim.Optimizer] = None, rng: bool = True,
         sharded: Any = None, rank: Optional[int] = None, group: Any = None, no_dist: bool = False) -> dict[str, Any]:
    """Restore a checkpoint saved at any layout or world size in place; {"step": ..., "extra": ...} as saved.

    The weights always; the optimizer's state and hyperparameters when `optimizer` is given (a
    checkpoint saved without one raises); a float16 loss scaler's state; with `rng`, torch's RNG state
    (this rank's own at the saved world size, rank 0's at another) and tpcompile's dropout RNG state.
    """
    path = str(path)
    if not os.path.isdir(path):
        raise TPCompileError(f"checkpoint directory {path!r} does not exist")
    me, world, alone = _where(group, no_dist)
    groups, known, finish = weight_groups(model, sharded, rank)
    after: list[Callable[[], None]] = []

    def more(md: Any, record: Optional[dict]) -> dict[str, tuple[Any, Want]]:
        """The optimizer's and the generators' tensors to read, once the checkpoint's metadata is known."""
        wanted: dict[str, tuple[Any, Want]] = {}
        if optimizer is not None:
            if record is None or record.get("optimizer") is None:
                raise TPCompileError(f"checkpoint {path!r} holds no optimizer state (it was saved without "
                                     f"optimizer=, or by stock torch.distributed.checkpoint); load it without "
                                     f"optimizer= to restore the weights alone")
            layouts = param_layouts(model, sharded, rank)
            found, install = optimizer_targets(optimizer, layouts, record["optimizer"], md, RankChunks.of)
            wanted.update(found)
            after.append(install)
        if rng and record is not None:
            found, restore = rng_targets(md, me, world, RankChunks.of)
            wanted.update(found)
            after.append(restore)
        return wanted

    record = read(path, groups, known, group=group, no_dist=alone, more=more)
    finish()
    for step in after:
        step()
    record = record or {}
    if rng:
        restore_dropout(record.get("dropout_rng"))
    scaler = _scaler(model)
    if scaler is not None and record.get("loss_scaler") is not None:
        scaler.load_state_dict(record["loss_scaler"])
    return {"step": record.get("step"), "extra": record.get("extra")}
