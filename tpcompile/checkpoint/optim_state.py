"""An optimizer's state in a checkpoint: per-parameter tensors laid out like their parameter, the rest as JSON.

A state tensor shaped like this rank's parameter (AdamW's exp_avg and exp_avg_sq: a tensor-parallel
slice, an FSDP shard) is written exactly as the parameter is, as chunks of a full tensor of the
parameter's global shape at their global offsets, under `optim.state.<parameter>.<key>` (the names
stock DCP gives a flattened get_optimizer_state_dict). So it reshards at any layout and world size
as the weights do. A 0-d state tensor (AdamW's per-parameter `step`) is written whole: the ranks
holding copies of a parameter write the same entry and DCP keeps one. Which state each parameter
has, and the param_groups' hyperparameters (lr, betas, ...), go to the checkpoint's JSON record; a
load rebuilds the optimizer's state from both through its own load_state_dict, so the dtype and
device rules are torch's.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from tpcompile.checkpoint.dcp_checks import OPTIM_PREFIX, Want
from tpcompile.checkpoint.layouts import Chunk, ParamLayout
from tpcompile.checkpoint.record import check_json
from tpcompile.errors import TPCompileError

__all__ = ["load_targets", "merge_manifests", "optimizer_values"]

Values = Callable[[tuple[int, ...], list[Chunk]], Any]  # DCP value from (global shape, chunks)


def _key(name: str, key: str) -> str:
    """The checkpoint entry of a parameter's state tensor."""
    return f"{OPTIM_PREFIX}{name}.{key}"


def _by_param(optimizer: torch.optim.Optimizer,
              layouts: list[ParamLayout]) -> list[list[tuple[torch.Tensor, ParamLayout]]]:
    """Each param group's (parameter, layout), raising for a parameter the model does not hold."""
    by_id = {id(lay.param): lay for lay in layouts}
    groups = []
    for i, group in enumerate(optimizer.param_groups):
        pairs = []
        for p in group["params"]:
            if id(p) not in by_id:
                raise TPCompileError(f"{type(optimizer).__name__}'s param group {i} holds a parameter of shape "
                                     f"{list(p.shape)} that this rank's model does not hold; build the optimizer from "
                                     f"the parallelized model's parameters (hm.parameters(), local.parameters())")
            pairs.append((p, by_id[id(p)]))
        groups.append(pairs)
    return groups


def _same_local_shape(value: torch.Tensor, param: torch.Tensor) -> bool:
    """True when a state tensor is laid out like its parameter (both local shapes, and global ones for DTensors)."""
    local = getattr(value, "to_local", None)
    plocal = getattr(param, "to_local", None)
    if (local is None) != (plocal is None):
        return False
    return tuple(value.shape) == tuple(param.shape) and (local is None or local().shape == plocal().shape)


def optimizer_values(optimizer: torch.optim.Optimizer, layouts: list[ParamLayout],
                     values: Values) -> tuple[dict[str, Any], dict[str, Any]]:
    """({key: DCP value} of this rank's optimizer state tensors, this rank's part of the JSON manifest)."""
    out: dict[str, Any] = {}
    state: dict[str, dict[str, Any]] = {}
    groups = []
    cls = type(optimizer).__name__
    for i, pairs in enumerate(_by_param(optimizer, layouts)):
        for p, lay in pairs:
            kinds: dict[str, Any] = {}
            for key, v in optimizer.state.get(p, {}).items():
                where = f"{cls} state {key!r} of {lay.name}"
                if isinstance(v, torch.Tensor) and v.dim() == 0 and not hasattr(v, "to_local"):
                    kinds[key] = {"tensor": "scalar"}
                    out[_key(lay.name, key)] = v.detach()
                elif isinstance(v, torch.Tensor) and _same_local_shape(v, p):
                    kinds[key] = {"tensor": "param"}
                    out[_key(lay.name, key)] = values(lay.global_shape, lay.chunks(v.detach()))
                elif isinstance(v, torch.Tensor):
                    raise TPCompileError(f"{where} has shape {list(v.shape)}, neither the parameter's "
                                         f"{list(p.shape)} nor a scalar; tpcompile.dcp reshards state laid out like "
                                         f"its parameter only: save this state yourself (extra=)")
                else:
                    check_json(v, where)
                    kinds[key] = {"value": v}
            state[lay.name] = kinds
        hyper = {k: _plain(v, f"{cls} param group {i}'s {k!r}") for k, v in optimizer.param_groups[i].items()
                 if k not in ("params", "param_names")}
        groups.append({"hyper": hyper, "params": [lay.name for _, lay in pairs]})
    return out, {"class": cls, "param_groups": groups, "state": state}


def _plain(value: Any, where: str) -> Any:
    """A hyperparameter as JSON data (a 0-d tensor, such as a tensor lr, by its number)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    check_json(value, where)
    return value


def merge_manifests(parts: list[Optional[dict[str, Any]]]) -> Optional[dict[str, Any]]:
    """Every rank's manifest made one: each parameter's state kinds, each group's parameter names."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    merged = {"class": parts[0]["class"], "state": {}, "param_groups": [dict(g) for g in parts[0]["param_groups"]]}
    for part in parts:
        merged["state"].update(part["state"])
        for i, group in enumerate(part["param_groups"]):
            if i < len(merged["param_groups"]):
                names = merged["param_groups"][i]["params"]
                merged["param_groups"][i]["params"] = list(dict.fromkeys([*names, *group["params"]]))
    return merged


def load_targets(optimizer: torch.optim.Optimizer, layouts: list[ParamLayout], manifest: dict[str, Any],
                 md: Metadata, values: Values) -> tuple[dict[str, tuple[Any, Want]], Callable[[], None]]:
    """The optimizer's state tensors to read ({key: (DCP value, Want)}) and the function that installs them."""
    cls = type(optimizer).__name__
    if manifest["class"] != cls:
        raise TPCompileError(f"the checkpoint's optimizer state is {manifest['class']}'s, but the optimizer given is "
                             f"a {cls}; pass the optimizer the checkpoint was saved with, or load without optimizer=")
    groups = _by_param(optimizer, layouts)
    saved_groups = manifest["param_groups"]
    if len(saved_groups) != len(groups):
        raise TPCompileError(f"the checkpoint's {cls} has {len(saved_groups)} param group(s), this one "
                             f"{len(groups)}; build the optimizer's groups as when it was saved")
    stored = {k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    wanted: dict[str, tuple[Any, Want]] = {}
    per_param: list[tuple[dict[str, Any], bool]] = []  # (state, a copy of a state read for another parameter)
    first: dict[str, dict[str, Any]] = {}  # a parameter held twice (tied copies): its state read once, then copied
    for i, pairs in enumerate(groups):
        names = set(saved_groups[i]["params"])
        for p, lay in pairs:
            saved = next((n for n in (lay.name, *lay.aliases) if n in names), None)
            if saved is None:
                raise TPCompileError(f"{lay.name} is in param group {i} of this {cls} but not in the checkpoint's "
                                     f"group {i}; build the optimizer's groups as when it was saved")
            if saved in first:
                per_param.append((first[saved], True))
                continue
            state: dict[str, Any] = {}
            for key, kind in manifest["state"].get(saved, {}).items():
                name = _key(saved, key)
                if "value" in kind:
                    state[key] = kind["value"]
                    continue
                dtype = stored[name].properties.dtype if name in stored else p.dtype
                if kind["tensor"] == "param":
                    target = torch.zeros_like(p, dtype=p.dtype if p.is_floating_point() else dtype)
                    chunks = lay.chunks(target)
                    wanted[name] = (values(lay.global_shape, chunks), Want(lay.global_shape, target.dtype))
                else:
                    target = torch.zeros((), dtype=dtype)
                    wanted[name] = (target, Want((), dtype))
                state[key] = target
            first[saved] = state
            per_param.append((state, False))

    def install() -> None:
        """Give the optimizer the state read (and the saved hyperparameters) through its load_state_dict."""
        sd = optimizer.state_dict()  # this optimizer's groups, its parameters numbered in order
        sd["state"] = {}
        for index, (state, copy) in enumerate(per_param):
            if state:  # a copy gets tensors of its own: the optimizer updates each parameter's state in place
                sd["state"][index] = {k: v.clone() if copy and isinstance(v, torch.Tensor) else v
                                      for k, v in state.items()}
        for i, group in enumerate(sd["param_groups"]):
            group.update(_restored(saved_groups[i]["hyper"], group))
        optimizer.load_state_dict(sd)
    return wanted, install


def _restored(hyper: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """Saved hyperparameters in the types the optimizer holds now (a tuple, a tensor lr)."""
    out = {}
    for k, v in hyper.items():
        now = current.get(k)
        if isinstance(now, tuple) and isinstance(v, list):
            v = tuple(v)
        elif isinstance(now, torch.Tensor):
            v = torch.tensor(v, dtype=now.dtype, device=now.device)
        out[k] = v
    return out
