"""The loop `tpcompile profile` runs in each rank process: shard, warm up, time bare steps, then profiled ones.

A training step is the rank module's forward, a loss (the mean square of every floating-point
output, summed: a stand-in that touches every output), backward and an AdamW step (with
`zero_grad`) in a region named "optimizer"; an inference step is a forward under no_grad. Each step,
bare or profiled, starts after a barrier, so both are timed alike.
"""
from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from tpcompile.errors import TPCompileError


@dataclass(frozen=True)
class RunSpec:
    """What every rank runs: the model, its inputs, how it is sharded, how many steps."""

    model: str
    config: dict
    state: dict
    args: tuple
    kwargs: dict
    world: int
    plan: Any
    sequence_parallel: bool
    train: bool
    steps: int
    warmup: int
    layers: Optional[list[str]]
    backend: str
    events: bool  # keep the raw events (for --trace)


def stand_in_loss(out: Any) -> torch.Tensor:
    """The mean square of every floating-point output tensor, summed (a TPCompileError when there is none)."""
    terms = [t.float().square().mean() for t in pytree.tree_leaves(out)
             if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if not terms:
        raise TPCompileError("tpcompile profile --train: the model returns no floating-point tensor that needs a "
                             "gradient, so there is nothing to train; leave out --train to profile its forward")
    return torch.stack(terms).sum()


def _steps(gm: Any, opt: Any, spec: RunSpec, prof: Any, n: int) -> list[float]:
    """Run n steps (profiled when prof is given); each one's wall time in ms."""
    times = []
    for _ in range(n):
        if prof is None and dist.is_initialized():
            dist.barrier()  # as Profile does before each step
        start = time.perf_counter()
        if spec.train:
            loss = stand_in_loss(gm(*spec.args, **spec.kwargs))
            loss.backward()
            if prof is not None:
                with prof.region("optimizer"):
                    opt.step()
                    opt.zero_grad()
            else:
                opt.step()
                opt.zero_grad()
        else:
            with torch.no_grad():
                gm(*spec.args, **spec.kwargs)
        if torch.cuda.is_available() and spec.backend == "nccl":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
        if prof is not None:
            prof.step()
    return times


@contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Send this process's file descriptor 2 to /dev/null while the block runs."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _to(value: Any, device: torch.device) -> Any:
    """value with every tensor moved to `device`."""
    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, value)


def profile_rank(rank: int, spec: RunSpec) -> dict[str, Any]:
    """One rank: its RankProfile and its bare steps' mean ms, or {'error': message} for a TPCompileError."""
    import tpcompile
    from tpcompile.models.spec import load_model
    from tpcompile.runtime.profiler import profile
    try:
        model, _, _ = load_model(spec.model, spec.config)
        model.load_state_dict(spec.state)  # the parent's weights exactly (a user's model may draw them at random)
        model.train(spec.train)
        with warnings.catch_warnings():  # the parent shows them
            warnings.simplefilter("ignore")
            sm = tpcompile.shard(model, spec.world, example_inputs=spec.args, example_kwargs=spec.kwargs,
                                 plan=spec.plan, sequence_parallel=spec.sequence_parallel)
        gm = sm.rank(rank)
        if spec.backend == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
            gm = gm.to(device)
            spec = RunSpec(**{**spec.__dict__, "args": _to(spec.args, device), "kwargs": _to(spec.kwargs, device)})
        opt = torch.optim.AdamW(gm.parameters(), lr=1e-4) if spec.train else None
        _steps(gm, opt, spec, None, spec.warmup)
        bare = _steps(gm, opt, spec, None, spec.steps)
        prof = profile(gm, layers=spec.layers)
        with _quiet_stderr():  # kineto prints a line to stderr when the profiler starts and one when it stops
            prof.__enter__()
        try:
            _steps(gm, opt, spec, prof, spec.steps + 1)
        finally:
            with _quiet_stderr():
                prof.__exit__(None, None, None)
    except TPCompileError as e:
        return {"error": str(e)}
    result = prof.result
    if result is not None:
        result.steps = result.steps[1:]  # the first profiled step also pays the profiler's own start
        if not spec.events:
            result.events = []
    return {"profile": result, "bare_ms": sum(bare) / max(len(bare), 1)}
