"""One rank's share of the benchmark: build every contender, check it, count its collectives, time it."""

from __future__ import annotations

import copy
import random
import time
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist

from tpcompile.ops import collectives as C

from bench.comm_count import CommCounter, summarize
from bench.contenders import CONTENDERS, Contender, build_contender, parameter_bytes
from bench.device import rank_device, synchronize
from bench.workloads import WORKLOADS, Workload

__all__ = ["LR", "rank_main"]

LR = 0.05  # SGD step size: large enough that wrong gradients change the second step's loss


def _first(out: Any) -> torch.Tensor:
    """The output tensor of a module (tensor, or the first element of a tuple/list)."""
    return out if isinstance(out, torch.Tensor) else out[0]


def _local(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a possibly distributed one."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train_step(wl: Workload, c: Contender, inputs: tuple) -> Callable[[], float]:
    """A closure doing forward, loss, backward and one SGD step; returns the loss."""
    opt = torch.optim.SGD(c.params, lr=LR)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = wl.loss(_local(_first(c.module(*inputs))), inputs)
        loss.backward()
        opt.step()
        return float(loss.detach())
    return step


def _why(e: Exception) -> str:
    """The exception's type and first line, for the report."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:240] if text else ''}"


def _synced_ok(ok: bool) -> bool:
    """True when every rank says ok."""
    flag = torch.tensor([1 if ok else 0], device=rank_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(int(flag))


def _timed(fn: Callable[[], Any], rank0_only: bool) -> float:
    """Seconds fn takes on the slowest rank, every rank starting together."""
    device = rank_device()
    dist.barrier()
    synchronize(device)
    start = time.perf_counter()
    if not rank0_only or dist.get_rank() == 0:
        fn()
    synchronize(device)  # a GPU returns before its kernels finish: the clock waits for them
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _check(wl: Workload, c: Contender, inputs: tuple, ref: torch.Tensor, ref_losses: list[float]) -> dict:
    """Forward difference from the original, collectives of one forward and one train step."""
    res: dict[str, Any] = {"param_bytes": parameter_bytes(c.params), "setup_s": c.setup_s, **c.info}
    try:
        with torch.no_grad(), C.record() as events, CommCounter() as cc:
            out = _local(_first(c.module(*inputs)))
        res["forward"] = {"diff": float((out - ref).abs().max()), **summarize(cc.calls)}
        res["forward"]["tpcompile_record"] = summarize(
            [(e.op, e.nbytes) for e in events if e.op in C.FORWARD_COLLECTIVES])
    except Exception as e:  # noqa: BLE001  a contender that cannot run a model is a result
        res["error"] = _why(e)
    if not _synced_ok("error" not in res):
        return {"error": res.get("error", "failed on another rank"), "setup_s": c.setup_s}
    train: dict[str, Any] = {}
    try:
        step = _train_step(wl, c, inputs)
        with CommCounter() as cc:
            losses = [step()]
        train.update(summarize(cc.calls))
        losses.append(step())
        train["loss_diff"] = max(abs(a - b) for a, b in zip(losses, ref_losses))
        train["losses"], train["ref_losses"] = losses, ref_losses
    except Exception as e:  # noqa: BLE001  a contender that cannot train is a result
        train["error"] = _why(e)
    if not _synced_ok("error" not in train):
        train.setdefault("error", "failed on another rank")
    res["train"] = train
    return res


def _reference(wl: Workload, inputs: tuple) -> tuple[torch.Tensor, list[float]]:
    """The original model's output and its first two training losses."""
    model = wl.build().to(inputs[0].device)
    with torch.no_grad():
        ref = _first(model(*inputs))
    c = Contender("reference", copy.deepcopy(model), list(model.parameters()))
    c.params = list(c.module.parameters())
    step = _train_step(wl, c, inputs)
    return ref, [step(), step()]


def run_workload(wl: Workload, rank: int, ws: int, reps: int, train_reps: int, warmup: int,
                 names: tuple = CONTENDERS) -> dict:
    """Every contender of one workload on this rank: checks, counts and interleaved timings."""
    device = rank_device()
    inputs = tuple(t.to(device) for t in wl.inputs())
    ref, ref_losses = _reference(wl, inputs)
    model = wl.build().to(device)
    out: dict[str, Any] = {}
    ready: dict[str, Contender] = {}
    for name in names:
        c = build_contender(name, wl, model, inputs, rank, ws)
        if c.error is not None:
            out[name] = {"error": c.error, "setup_s": c.setup_s}
            continue
        out[name] = _check(wl, c, inputs, ref, ref_losses)
        if "error" not in out[name]:
            ready[name] = c
    fwd = {n: (lambda c=c: _no_grad(c.module, inputs)) for n, c in ready.items()}
    steps = {n: _train_step(wl, c, inputs) for n, c in ready.items() if "error" not in out[n]["train"]}
    for label, fns, n_reps in (("forward", fwd, reps), ("train", steps, train_reps)):
        for fn in fns.values():
            for _ in range(warmup):
                fn()
        times: dict[str, list[float]] = {n: [] for n in fns}
        for i in range(n_reps):
            # A fresh order each repetition (the same on every rank: seeded by the repetition), so
            # no contender always follows the same one and inherits its cache and load state.
            order = list(fns)
            random.Random(i).shuffle(order)
            for n in order:
                times[n].append(_timed(fns[n], rank0_only=(n == "single")))
        for n, t in times.items():
            out[n][label]["times"] = t
    return out


def _no_grad(module: Callable, inputs: tuple) -> Any:
    """module(*inputs) without autograd, its collectives finished."""
    with torch.no_grad():
        return _settled(module(*inputs))


def _settled(out: Any) -> Any:
    """out with every pending functional collective waited for.

    DTensor hands back the result of its last all-reduce unwaited (an AsyncCollectiveTensor); a
    forward whose output nobody reads would leave it in flight, outside the timing and still
    registered when the process ends, where torch warns about "unwaited collective calls".
    """
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    if isinstance(out, AsyncCollectiveTensor):
        return out.wait()
    if isinstance(out, (tuple, list)):
        return type(out)(_settled(o) for o in out)
    return out


def rank_main(rank: int, ws: int, specs: list[tuple[str, dict]], reps: int, train_reps: int,
              warmup: int) -> dict:
    """Entry point of a rank process (tpcompile.runtime.launch); specs name workload factories."""
    # torch's own deprecation, raised inside copy.deepcopy of its tree specs; nothing a reader can act on
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning)
    out = {}
    for name, kwargs in specs:
        wl = WORKLOADS[name](**kwargs)
        out[wl.name] = run_workload(wl, rank, ws, reps, train_reps, warmup)
    return out
