"""One 2-rank gloo launch of the mixed-precision cases (tests/test_mixed_precision.py reads its results).

On each rank: `parallelize` in bf16 (with sequence parallelism, so replicated norm weights have their
gradients summed in the graph) and fp16 with a LossScaler, against the same policy in one process;
`parallelize_train` in bf16 under FSDP at dp 2 (recording the dtypes of FSDP's all-gathers and
reduce-scatters) and under DDP at dp 2; and fp16 at tp 2 with an inf put into one gradient on rank 1
at the second step; gradient accumulation over three steps (two inside `no_sync`) under FSDP and DDP;
and cpu_offload refused on a CPU process.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tpcompile
from tpcompile.runtime.loss_scale import LossScaler

TINY = dict(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
STEPS = 3


def gpt() -> torch.nn.Module:
    """The tiny GPT, seed 0."""
    from tpcompile.models import GPT, GPTConfig
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return GPT(GPTConfig(**TINY)).train()


def batch(step: int, rows: int = 4) -> torch.Tensor:
    """Step `step`'s token ids."""
    return torch.randint(0, 64, (rows, 12), generator=torch.Generator().manual_seed(100 + step))


def loss_fn(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy in float32."""
    logits = logits.float()
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def reference(policy: str, steps: int = STEPS) -> list[float]:
    """The policy in one process: float32 parameters cast to the compute dtype per forward, AdamW in float32."""
    model = gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = LossScaler() if policy == "fp16" else None
    losses = []
    for step in range(steps):
        opt.zero_grad()
        params = {n: p.to(DTYPES[policy]) for n, p in model.named_parameters()}
        loss = loss_fn(torch.func.functional_call(model, params, (batch(step),)), batch(step))
        (loss if scaler is None else scaler.scale(loss)).backward()
        if scaler is not None:
            scaler.unscale_(model.parameters())
            scaler.update()
        opt.step()
        losses.append(loss.item())
    return losses


def _parallelize(policy: str) -> dict:
    """parallelize in the policy: losses, parameter, gradient and optimizer-state dtypes, gradient-sync bytes."""
    from tpcompile.ops.collectives import record
    gm = tpcompile.parallelize(gpt(), example_inputs=(batch(0),), mixed_precision=policy, sequence_parallel=True)
    opt = torch.optim.AdamW(gm.parameters(), lr=1e-2)
    scaler = LossScaler() if policy == "fp16" else None
    losses, syncs = [], []
    for step in range(STEPS):
        opt.zero_grad()
        with record() as events:
            loss = loss_fn(gm(batch(step)), batch(step))
            (loss if scaler is None else scaler.scale(loss)).backward()
        syncs += [(len(e.shape), e.nbytes // max(1, _numel(e.shape))) for e in events if e.phase == "backward"]
        if scaler is not None:
            scaler.unscale_(gm.parameters())
            scaler.update()
        opt.step()
        losses.append(loss.item())
    states = {str(t.dtype) for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()}
    return {"losses": losses, "params": sorted({str(p.dtype) for p in gm.parameters()}),
            "grads": sorted({str(p.grad.dtype) for p in gm.parameters() if p.grad is not None}),
            "optimizer": sorted(states), "backward_syncs": sorted(set(syncs))}


def _numel(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


class _Dtypes:
    """Records the dtype of every FSDP all-gather and reduce-scatter while active."""

    def __enter__(self) -> "_Dtypes":
        self.seen: dict[str, set[str]] = {"all_gather": set(), "reduce_scatter": set()}
        self.saved = dist.all_gather_single, dist.reduce_scatter_single

        def gather(*a: Any, **k: Any) -> Any:
            self.seen["all_gather"].add(str(k.get("input", a[1] if len(a) > 1 else None).dtype))
            return self.saved[0](*a, **k)

        def scatter(*a: Any, **k: Any) -> Any:
            self.seen["reduce_scatter"].add(str(k.get("input", a[1] if len(a) > 1 else None).dtype))
            return self.saved[1](*a, **k)
        dist.all_gather_single, dist.reduce_scatter_single = gather, scatter
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.all_gather_single, dist.reduce_scatter_single = self.saved


def _train(rank: int, dims: dict, policy: str, data_parallel: str = "fsdp", poison_at: int = -1) -> dict:
    """parallelize_train in the policy on a mesh; losses, dtypes seen, and per step whether it was skipped."""
    mesh = tpcompile.init_mesh(**dims)
    hm = tpcompile.parallelize_train(gpt(), mesh, loss_fn=loss_fn, example_inputs=(batch(0),),
                                     mixed_precision=policy, data_parallel=data_parallel)
    opt = torch.optim.AdamW(hm.parameters(), lr=1e-2)
    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    losses, skipped, moved = [], [], []
    if poison_at >= 0 and rank == 1:  # an overflow in one gradient of this rank only, at one step
        real = hm.pipeline.step

        def poisoned(*a: Any, **k: Any) -> Any:
            out = real(*a, **k)
            if len(losses) == poison_at:
                p = next(p for p in hm.parameters() if p.grad is not None)
                p.grad.view(-1)[0] = float("inf")
            return out
        hm.pipeline.step = poisoned
    with _Dtypes() as dtypes:
        for step in range(STEPS):
            opt.zero_grad()
            mine = batch(step)[dp_rank * 4 // dp:(dp_rank + 1) * 4 // dp]
            before = [p.detach().clone() for p in hm.parameters()]
            losses.append(float(hm.step(mine, target=mine)))
            opt.step()
            skipped.append(hm.last_step_skipped)
            moved.append(any(not torch.equal(b, p.detach()) for b, p in zip(before, hm.parameters())))
    states = {str(t.dtype) for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()}
    return {"losses": losses, "skipped": skipped, "moved": moved, "seen": {k: sorted(v) for k, v in dtypes.seen.items()},
            "optimizer": sorted(states), "params": sorted({str(p.dtype) for p in hm.parameters()}),
            "scale": hm.scaler.value if hm.scaler is not None else None}


def accumulated_reference() -> dict[str, torch.Tensor]:
    """The gradients of three steps' losses summed in one float64 process (what accumulation must give)."""
    model = gpt().double()
    for step in range(3):
        loss_fn(model(batch(step)), batch(step)).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _accumulate(rank: int, data_parallel: str) -> dict:
    """Two steps inside no_sync and one after at dp 2: reduce-scatters during no_sync, the summed gradients."""
    mesh = tpcompile.init_mesh(dp=2)
    hm = tpcompile.parallelize_train(gpt().double(), mesh, loss_fn=loss_fn, example_inputs=(batch(0),),
                                     data_parallel=data_parallel)
    calls: list[int] = []
    saved = dist.reduce_scatter_single

    def counted(*a: Any, **k: Any) -> Any:
        calls.append(1)
        return saved(*a, **k)
    dist.reduce_scatter_single = counted
    try:
        with hm.no_sync():
            for step in range(2):
                mine = batch(step)[2 * rank:2 * rank + 2]
                hm.step(mine, target=mine)
        during = len(calls)
        mine = batch(2)[2 * rank:2 * rank + 2]
        hm.step(mine, target=mine)
    finally:
        dist.reduce_scatter_single = saved
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach()
             for n, p in hm.named_parameters()}
    return {"during": during, "after": len(calls) - during, "grads": grads}


def _offload_refused() -> str:
    """cpu_offload=True on a CPU process: the error's message."""
    try:
        tpcompile.parallelize_train(gpt(), tpcompile.init_mesh(dp=2), loss_fn=loss_fn, example_inputs=(batch(0),),
                                    cpu_offload=True)
    except tpcompile.TPCompileError as e:
        return str(e)
    return ""


def rank_cases(rank: int) -> dict:
    """Every case on this rank, with the one-process references."""
    return {"reference": {p: reference(p) for p in ("bf16", "fp16")},
            "parallelize": {p: _parallelize(p) for p in ("bf16", "fp16")},
            "fsdp_bf16": _train(rank, dict(dp=2), "bf16"),
            "ddp_bf16": _train(rank, dict(dp=2), "bf16", data_parallel="ddp"),
            "tp_fp16_inf": _train(rank, dict(tp=2), "fp16", poison_at=1),
            "accumulate": {d: _accumulate(rank, d) for d in ("fsdp", "ddp")},
            "offload": _offload_refused()}


@functools.cache
def results() -> list[dict]:
    """Both ranks' results, from one launch per test process."""
    from tpcompile.runtime import launch
    return launch(2, rank_cases, timeout=300)
