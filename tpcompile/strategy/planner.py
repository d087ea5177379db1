"""plan_parallel(): capture the model once, read its costs at every tensor-parallel degree, search, explain.

    capture      profile.build_profile       torch.export at the planning shapes -> block chain with costs
    tp degrees   tp_profile.tp_profile       tpcompile's passes and rank-0 graph per degree -> split costs
    search       search.search               every layout priced by cost.estimate, units by decisions.decide
    record       record.build                Strategy: choice, predictions, alternatives and why they lost
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from tpcompile.errors import TPCompileError
from tpcompile.strategy.cluster import Cluster, as_cluster
from tpcompile.strategy.profile import build_profile
from tpcompile.strategy.record import Strategy, build
from tpcompile.strategy.search import search, tp_degrees
from tpcompile.strategy.tp_profile import tp_profile

ModelLike = Union[nn.Module, str, Callable[[], nn.Module]]


def meta_model(model: ModelLike, config: Optional[dict] = None) -> tuple[nn.Module, tuple, dict]:
    """A module and its example inputs: a module as given, a MODEL string or a factory built on the meta device."""
    if isinstance(model, nn.Module):
        return model, (), {}
    if isinstance(model, str):
        from tpcompile.models.spec import load_model
        with torch.device("meta"):
            return load_model(model, config)
    if callable(model):
        with torch.device("meta"):
            built = model()
        if not isinstance(built, nn.Module):
            raise TPCompileError(f"the model factory returned a {type(built).__name__}, not an nn.Module")
        return built, (), {}
    raise TPCompileError(f"plan_parallel expects an nn.Module, a MODEL string (e.g. 'hf:llama') or a factory, "
                         f"got {type(model).__name__}")


def _positive(name: str, value: Any, optional: bool = False) -> Optional[int]:
    if optional and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TPCompileError(f"plan_parallel: {name} must be an int >= 1, got {value!r}")
    return value


def plan_parallel(model: ModelLike, cluster: Union[Cluster, dict, str], *, example_inputs: Any = (),
                  example_kwargs: Optional[dict] = None, global_batch: int, seq_len: Optional[int],
                  training: bool = True) -> Strategy:
    """The fastest parallel layout of `model` on `cluster` that fits in memory, as a Strategy.

    `model` is captured, never run: build it under `torch.device("meta")` to plan without
    allocating weights (a MODEL string or a factory is built there for you). `global_batch` is
    in samples per step, `seq_len` in tokens per sample (None: the example inputs' length).
    """
    start = time.perf_counter()
    cl = as_cluster(cluster)
    _positive("global_batch", global_batch)
    _positive("seq_len", seq_len, optional=True)
    module, args, kwargs = meta_model(model)
    args = tuple(example_inputs) if example_inputs not in ((), None) else args
    kwargs = dict(example_kwargs) if example_kwargs is not None else kwargs
    profile = build_profile(module, example_inputs=args, example_kwargs=kwargs, seq_len=seq_len)
    tpps = {t: tp_profile(profile, t) for t in tp_degrees(cl)}  # degree 1 too: the runtime runs its graph
    result = search(profile, tpps, cl, global_batch, training)
    names = [b.name for b in profile.blocks]
    others = [e for e in result.per_mesh if e is not result.best]
    notes = []
    layers = sum(b.repeated for b in profile.blocks)
    if not layers:
        notes.append(f"{profile.name} has no repeated layers (a ModuleList or Sequential of one module type): "
                     "pipeline parallelism was not considered")
    strategy = build(result.best, others, result.decisions.get(result.best.layout, []), cl, profile.name, names,
                     global_batch, profile.seq_len, training, notes)
    strategy.capture_s = profile.capture_s
    strategy.planning_s = time.perf_counter() - start
    return strategy
