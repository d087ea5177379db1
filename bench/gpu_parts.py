"""The parts of the one-GPU check (bench/gpu.py); each takes the run's Setup and returns what it measured.

Every part returns a dict with "ok" (bool) and its numbers; a part that raises is reported as
failed by the driver, and the others still run. `Setup.dry` selects tiny sizes on the CPU.
"""
from __future__ import annotations

import copy
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

import tpcompile
from tpcompile.ops.collectives import record

H200_NOMINAL_BYTES_PER_S = 4.8e12  # the H200 datasheet's HBM3e bandwidth
RTOL_BF16 = 2e-2  # bf16 losses against the same policy in one process
TINY_GPT = dict(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32)
GPT_4x512 = dict(n_layer=4, n_embd=512, n_head=8, block_size=256)  # the bundled GPT's vocabulary of 256


@dataclass
class Setup:
    """Where and how big: the device, tiny sizes or real ones, and the measured copy bandwidth."""

    device: torch.device
    dry: bool
    bandwidth: float = 0.0  # bytes/s, from the bandwidth part


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds fn takes, its device work included."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def environment(s: Setup) -> dict:
    """Versions, the device and the process group the other parts use."""
    import torch.distributed as dist
    import transformers
    out = {"torch": torch.__version__, "transformers": transformers.__version__, "tpcompile": tpcompile.__version__,
           "device": str(s.device), "backend": dist.get_backend(), "world_size": dist.get_world_size(),
           "cuda": torch.version.cuda}
    if s.device.type == "cuda":
        props = torch.cuda.get_device_properties(s.device)
        out.update(name=props.name, memory_bytes=props.total_memory,
                   capability=list(torch.cuda.get_device_capability(s.device)))
    out["ok"] = out["world_size"] == 1 and (s.dry or (s.device.type == "cuda" and out["backend"] == "nccl"))
    return out


def bandwidth(s: Setup) -> dict:
    """Device memory bandwidth from a large device-to-device copy (bytes read plus bytes written)."""
    n = (32 if s.dry else 2048) * 2**20
    src = torch.empty(n, dtype=torch.uint8, device=s.device).fill_(1)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    iters = 5 if s.dry else 20
    seconds = timed(lambda: [dst.copy_(src) for _ in range(iters)], s.device)
    s.bandwidth = 2 * n * iters / seconds
    return {"ok": True, "bytes_per_copy": n, "copies": iters, "seconds": seconds, "bytes_per_s": s.bandwidth,
            "nominal_bytes_per_s": H200_NOMINAL_BYTES_PER_S,
            "fraction_of_nominal": s.bandwidth / H200_NOMINAL_BYTES_PER_S}


def _gpt(**overrides: Any) -> torch.nn.Module:
    """The bundled GPT (small when dry), seed 0."""
    from tpcompile.models import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(**overrides)).train()


def _ids(vocab: int, shape: tuple, device: torch.device, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed)).to(device)


def rank_graph(s: Setup) -> dict:
    """tpcompile.parallelize at world size 1: the rank graph's tensors on the device, its output the model's."""
    cfg = TINY_GPT if s.dry else GPT_4x512
    model = _gpt(**cfg).eval()
    ids = _ids(model.config.vocab_size, (4, 32 if s.dry else 256), s.device)
    reference = copy.deepcopy(model).to(s.device)
    gm = tpcompile.parallelize(model, example_inputs=(ids.cpu(),), device=s.device)  # captured where the model is
    with torch.no_grad(), record() as events:
        out = gm(ids)
    with torch.no_grad():
        want = reference(ids)
        forward_s = min(timed(lambda: gm(ids), s.device) for _ in range(5))
    devices = sorted({str(t.device) for t in list(gm.parameters()) + list(gm.buffers())})
    diff = float((out - want).abs().max())
    return {"ok": diff < 1e-3 and devices == [str(out.device)] and out.device.type == s.device.type,
            "max_abs_diff": diff, "tensor_devices": devices, "collectives": [e.op for e in events],
            "forward_ms": 1e3 * forward_s}


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy in float32."""
    logits = logits.float()
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _reference_losses(model: torch.nn.Module, batches: list[torch.Tensor]) -> list[float]:
    """The bf16 policy in one process: float32 parameters cast per forward, AdamW on the float32 masters."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for ids in batches:
        opt.zero_grad()
        params = {n: p.to(torch.bfloat16) for n, p in model.named_parameters()}
        loss = _loss(torch.func.functional_call(model, params, (ids,)), ids)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def train_bf16(s: Setup) -> dict:
    """A bf16 mixed-precision training step: parallelize_train on a one-process mesh, and parallelize."""
    cfg = TINY_GPT if s.dry else GPT_4x512
    shape = (4, 16) if s.dry else (8, 256)
    batches = [_ids(cfg.get("vocab_size", 256), shape, s.device, seed=10 + i) for i in range(3)]
    want = _reference_losses(_gpt(**cfg).to(s.device), batches)
    out: dict[str, Any] = {"reference_losses": want}
    mesh = tpcompile.init_mesh()
    hm = tpcompile.parallelize_train(_gpt(**cfg), mesh, loss_fn=_loss, example_inputs=(batches[0].cpu(),),
                                     mixed_precision="bf16")
    opt = torch.optim.AdamW(hm.parameters(), lr=1e-3)
    losses = []
    for ids in batches:
        opt.zero_grad()
        losses.append(float(hm.step(ids, target=ids)))
        opt.step()
    out["parallelize_train"] = {"losses": losses, "params": sorted({str(p.dtype) for p in hm.parameters()}),
                                "devices": sorted({str(p.device) for p in hm.parameters()})}
    gm = tpcompile.parallelize(_gpt(**cfg), example_inputs=(batches[0].cpu(),), mixed_precision="bf16",
                              device=s.device)
    opt = torch.optim.AdamW(gm.parameters(), lr=1e-3)
    losses = []
    for ids in batches:
        opt.zero_grad()
        loss = _loss(gm(ids), ids)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    out["parallelize"] = {"losses": losses, "grads": sorted({str(p.grad.dtype) for p in gm.parameters()
                                                             if p.grad is not None})}
    close = [all(abs(a - b) <= RTOL_BF16 * abs(b) for a, b in zip(run["losses"], want))
             for run in (out["parallelize_train"], out["parallelize"])]
    out["ok"] = all(close) and out["parallelize_train"]["params"] == ["torch.float32"] and \
        out["parallelize"]["grads"] == ["torch.float32"]
    return out


def compile_rank(s: Setup) -> dict:
    """torch.compile (inductor) of a rank graph with its collectives lowered, forward and backward, against eager."""
    model = _gpt(**(dict(vocab_size=64, block_size=32, n_layer=1, n_head=4, n_embd=32) if s.dry else dict(n_layer=1)))
    ids = _ids(model.config.vocab_size, (2, 16), s.device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tpcompile.TPCompileWarning)
        gm = tpcompile.parallelize(model, example_inputs=(ids.cpu(),), device=s.device,
                                   comm=tpcompile.CommOptions(lower_c10d=True))

    def step(call: Callable) -> tuple[torch.Tensor, dict]:
        gm.zero_grad(set_to_none=True)
        out = call(ids)
        out.float().pow(2).mean().backward()
        return out.detach().float(), {n: p.grad.clone() for n, p in gm.named_parameters() if p.grad is not None}

    ref_out, ref_grads = step(gm)
    torch._dynamo.reset()
    compiled = torch.compile(gm, backend="inductor")
    start = time.perf_counter()
    out, grads = step(compiled)
    sync(s.device)
    first = time.perf_counter() - start
    nxt = timed(lambda: step(compiled), s.device)
    diff = max([float((out - ref_out).abs().max())] + [float((grads[k] - g).abs().max()) for k, g in ref_grads.items()])
    return {"ok": diff < 1e-3, "max_abs_diff": diff, "first_step_s": first, "next_step_s": nxt}


RATIO_CONTENDERS = ("one process", "hand-written", "tpcompile", "tpcompile, comm=False")


def _contenders(model: torch.nn.Module, hand_cls: type, inputs: tuple, device: torch.device) -> dict:
    """The bench's forward contenders at world size 1 on the device (bench/comm_ratio.py's, and one process)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tpcompile.TPCompileWarning)
        return {"one process": copy.deepcopy(model).to(device), "hand-written": hand_cls(model, 0, 1).to(device),
                "tpcompile": tpcompile.parallelize(copy.deepcopy(model), example_inputs=inputs, device=device),
                "tpcompile, comm=False": tpcompile.parallelize(copy.deepcopy(model), example_inputs=inputs,
                                                               device=device, comm=False)}


def forward_ratios(s: Setup) -> dict:
    """The bench's MLP and GPT forwards (bench/workloads.py) at world size 1: each contender's time over the
    hand-written split's in the same repetition, interleaved; outputs checked against one process first."""
    from bench.handwritten_mlp import TPMLPStack
    from bench.handwritten_tp import TPGPT
    from bench.workloads import gpt_workload, mlp_workload
    tiny = dict(mlp=dict(width=32, hidden=64, pairs=2, batch=(2, 8)),
                gpt=dict(vocab=64, block=16, layers=2, heads=4, embd=32, batch=(2, 8)))
    reps, iters = (2, 1) if s.dry else (15, 10)
    out: dict[str, Any] = {"reps": reps, "iters": iters, "ok": True}
    for name, factory, hand_cls in (("mlp", mlp_workload, TPMLPStack), ("gpt", gpt_workload, TPGPT)):
        wl = factory(**(tiny[name] if s.dry else {}))
        model, inputs = wl.build(), wl.inputs()
        modules = _contenders(model, hand_cls, inputs, s.device)
        args = tuple(x.to(s.device) for x in inputs)
        with torch.no_grad():
            outs = {k: m(*args) for k, m in modules.items()}
            diffs = {k: float((o - outs["one process"]).abs().max()) for k, o in outs.items()}
            times: dict[str, list[float]] = {k: [] for k in modules}
            for rep in range(reps):
                order = RATIO_CONTENDERS[rep % 4:] + RATIO_CONTENDERS[:rep % 4]
                for k in order:
                    times[k].append(timed(lambda: [modules[k](*args) for _ in range(iters)], s.device) / iters)
        ratios = {k: statistics.median(t / h for t, h in zip(times[k], times["hand-written"])) for k in modules}
        ok = max(diffs.values()) < 1e-3
        out[name] = {"ok": ok, "max_abs_diff": diffs, "ratio_to_hand_written": ratios,
                     "hand_written_ms": 1e3 * statistics.median(times["hand-written"]), "describe": wl.describe}
        out["ok"] = out["ok"] and ok
    return out
