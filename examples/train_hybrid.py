"""Train a model with tensor x data x pipeline parallelism and print its losses.

    python examples/train_hybrid.py --dp 1 --tp 1 --pp 1 --model gpt --inputs 8x16:long --steps 5 --json
    torchrun --nproc-per-node 8 examples/train_hybrid.py --dp 2 --tp 2 --pp 2 --model gpt \\
        --inputs 8x16:long --steps 5 --microbatches 2 --json

Under torchrun every process joins one DeviceMesh (tpcompile.init_mesh) and trains its part
(tpcompile.parallelize_train); rank 0 prints one JSON object whose "losses" holds the global
batch's loss per step. Without torchrun, `--dp 1 --tp 1 --pp 1` trains the plain model in this
process: the reference, from the same weights (MODEL built after torch.manual_seed(0), in the
reference and on every rank) and the same batches (drawn from --seed). The loss is next-token cross entropy on the logits; the optimizer AdamW.
MODEL is as in the tpcompile CLI: file.py:NAME, pkg.mod:NAME, gpt, hf:<model_type>.

With --checkpoint-dir D --save-every N [--keep K] the whole training state (weights, AdamW state,
step, RNG states) is saved to D/step_<n> every N steps (tpcompile.dcp.save_step, the newest K kept),
and a launch whose D holds a complete checkpoint resumes from the latest one at the layout it is
launched with, the reference too; --steps is the run's total, "start_step" the step this launch began
at, "losses" the steps it ran and "all_losses" every step's (the earlier ones kept in the checkpoint's
extra). Batch i depends only on --seed and i, so the step is the data position.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tpcompile
import tpcompile.dcp
from tpcompile.cli.common import parse_config
from tpcompile.cli.inputs import parse_input_spec
from tpcompile.models.spec import load_model

LAYER_KEYS = ("n_layer", "num_hidden_layers")  # the bundled GPT's and Hugging Face's name for the depth


def logits_of(output: Any) -> torch.Tensor:
    """The logits in a model's output: a tensor, the first of a tuple, or a ModelOutput's .logits."""
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "logits"):
        return output.logits
    return output[0]


def next_token_loss(output: Any, ids: torch.Tensor) -> torch.Tensor:
    """Cross entropy of predicting token t+1 from positions <= t (in float32 whatever the logits' dtype)."""
    logits = logits_of(output).float()
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def build_model(spec: str, config: dict) -> tuple[torch.nn.Module, tuple, dict]:
    """The model MODEL names, built after torch.manual_seed(0): the same weights in every process."""
    torch.manual_seed(0)
    return load_model(spec, config)


def setup(opts: argparse.Namespace) -> tuple[torch.nn.Module, list[torch.Tensor], tuple, dict]:
    """The model (seed 0, training mode, --dtype), the batches of every step, and how to call it."""
    config = parse_config(opts.config or [])
    model, args, kwargs = build_model(opts.model, config)
    if opts.layers is not None:
        key = next((k for k in LAYER_KEYS if hasattr(getattr(model, "config", None), k)), LAYER_KEYS[0])
        model, args, kwargs = build_model(opts.model, {**config, key: opts.layers})
    model = model.to(getattr(torch, opts.dtype)).train()
    spec = parse_input_spec(opts.inputs)
    vocab = next((m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    high = spec.high or vocab
    if len(spec.shape) != 2 or spec.dtype.is_floating_point or not high:
        raise tpcompile.TPCompileError(f"--inputs {opts.inputs!r}: expected token ids BxT:long for a model "
                                       f"with a token embedding")
    # at least one batch: the hybrid run captures the model with it (--steps 0 only loads and saves)
    return model, batches(spec.shape, high, max(opts.steps, 1), opts.seed), args, kwargs


def batches(shape: tuple[int, ...], vocab: int, steps: int, seed: int) -> list[torch.Tensor]:
    """One (B, T) batch per step; each sequence follows one fixed random successor table, so loss falls."""
    gen = torch.Generator().manual_seed(seed)
    succ = torch.randperm(vocab, generator=gen)
    out = []
    for _ in range(steps):
        ids = torch.empty(shape, dtype=torch.long)
        ids[:, 0] = torch.randint(0, vocab, (shape[0],), generator=gen)
        for t in range(1, shape[1]):
            ids[:, t] = succ[ids[:, t - 1]]
        out.append(ids)
    return out


def call(ids: torch.Tensor, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The model's arguments for a batch of ids: the first tensor input replaced, other options kept.

    A model without example inputs of its own (a file.py:NAME without example_inputs()) takes the ids
    as its one positional argument.
    """
    rest = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
    name = next((k for k, v in kwargs.items() if isinstance(v, torch.Tensor)), None)
    if args or name is None:
        return (ids,), rest
    return (), {name: ids, **rest}


def in_policy(model: torch.nn.Module, a: tuple, k: dict, mixed_precision: Any) -> Any:
    """The model's forward in the --mixed-precision policy: float32 parameters cast to the compute dtype for
    this call (buffers as they are), so the gradients reach the float32 parameters; plain forward without it."""
    if mixed_precision is None:
        return model(*a, **k)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[mixed_precision]
    params = {n: p.to(dtype) if p.is_floating_point() else p for n, p in model.named_parameters()}
    return torch.func.functional_call(model, params, a, k)


def reference(opts: argparse.Namespace) -> dict:
    """The plain model trained in this process: losses (and gradient norms with --clip)."""
    from tpcompile.runtime.loss_scale import LossScaler
    model, batches, args, kwargs = setup(opts)
    if opts.load:
        import torch.distributed.checkpoint as dcp
        dcp.load(model.state_dict(), checkpoint_id=opts.load, no_dist=True)
    opt = torch.optim.AdamW(model.parameters(), lr=opts.lr)
    scaler = LossScaler() if opts.mixed_precision == "fp16" else None
    if scaler is not None:
        model.scaler = scaler  # tpcompile.dcp saves and restores a model's LossScaler .scaler, as a HybridModel's
    start, before = resume(opts, model, opt)
    losses, norms, times = [], [], []
    for step, ids in enumerate(batches[start:opts.steps], start):
        began = time.perf_counter()
        opt.zero_grad()
        a, k = call(ids, args, kwargs)
        loss = next_token_loss(in_policy(model, a, k, opts.mixed_precision), ids)
        (loss if scaler is None else scaler.scale(loss)).backward()
        if scaler is not None:  # an overflow clears the gradients: the step below moves nothing
            scaler.unscale_(model.parameters())
            scaler.update()
        if opts.clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), opts.clip)))
        opt.step()
        losses.append(loss.item())
        times.append((time.perf_counter() - began) * 1e3)
        periodic_save(opts, model, opt, step + 1, before + losses)
    if opts.save:
        import torch.distributed.checkpoint as dcp
        dcp.save(model.state_dict(), checkpoint_id=opts.save, no_dist=True)
    out = {"dp": 1, "tp": 1, "pp": 1, "world_size": 1, "start_step": start, "losses": losses,
           "all_losses": before + losses, "step_ms": times, "tokens_per_step": batches[0].numel(),
           "model_param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}
    if scaler is not None:
        out["skipped_steps"] = scaler.skipped
    return {**out, "grad_norms": norms} if opts.clip else out


def resume(opts: argparse.Namespace, model: Any, opt: torch.optim.Optimizer) -> tuple[int, list[float]]:
    """With --checkpoint-dir: the latest complete checkpoint there loaded; (the step to start from, earlier losses)."""
    path = tpcompile.dcp.latest(opts.checkpoint_dir) if opts.checkpoint_dir else None
    if path is None:
        return 0, []
    state = tpcompile.dcp.load(model, path, optimizer=opt)
    return state["step"], list((state["extra"] or {}).get("losses", []))


def periodic_save(opts: argparse.Namespace, model: Any, opt: torch.optim.Optimizer, done: int,
                  losses: list[float]) -> None:
    """With --save-every N: the whole training state after every N-th step (every rank), the losses so far in it."""
    if opts.save_every and done % opts.save_every == 0:
        tpcompile.dcp.save_step(model, opts.checkpoint_dir, done, optimizer=opt, extra={"losses": losses},
                                keep=opts.keep)


def distributed(opts: argparse.Namespace) -> dict:
    """This rank's part of the hybrid run; the report (on rank 0) of every rank."""
    mesh = tpcompile.init_mesh(dp=opts.dp, tp=opts.tp, pp=opts.pp)
    model, batches, args, kwargs = setup(opts)
    dp_rank, per = mesh["dp"].get_local_rank(), batches[0].shape[0] // opts.dp
    if per * opts.dp != batches[0].shape[0]:
        raise tpcompile.TPCompileError(f"--inputs batch {batches[0].shape[0]} is not divisible by --dp {opts.dp}")
    a, k = call(batches[0][:per], args, kwargs)
    start = time.perf_counter()
    hm = tpcompile.parallelize_train(model, mesh, loss_fn=next_token_loss, example_inputs=a, example_kwargs=k,
                                     microbatches=opts.microbatches, schedule=opts.schedule,
                                     data_parallel=opts.data_parallel, weights=opts.load,
                                     sequence_parallel=opts.sequence_parallel,
                                     activation_checkpointing=opts.activation_checkpointing,
                                     mixed_precision=opts.mixed_precision)
    setup_s = time.perf_counter() - start
    opt = torch.optim.AdamW(hm.parameters(), lr=opts.lr)
    first, before = resume(opts, hm, opt)
    losses, norms, times, start = [], [], [], time.perf_counter()
    for step, ids in enumerate(batches[first:opts.steps], first):
        began = time.perf_counter()
        mine = ids[dp_rank * per:(dp_rank + 1) * per]  # this data-parallel rank's share of the batch
        opt.zero_grad()
        a, k = call(mine, args, kwargs)
        loss = hm.step(*a, target=mine, **k)
        if opts.clip:
            norms.append(hm.clip_grad_norm_(opts.clip).item())
        opt.step()
        losses.append(loss.item())
        times.append((time.perf_counter() - began) * 1e3)
        periodic_save(opts, hm, opt, step + 1, before + losses)
    step_s = (time.perf_counter() - start) / max(1, opts.steps - first)
    if opts.save:
        tpcompile.dcp.save(hm, opts.save)
    mine_report = {"param_bytes": hm.parameter_bytes(), "peak_rss_bytes": _peak_bytes(),
                   "stages": hm.stage_indices, "losses": losses, "norms": norms}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine_report)
    for key in ("losses", "norms"):  # every rank must see the same loss and clip by the same norm
        if any(r[key] != mine_report[key] for r in every):
            raise SystemExit(f"the ranks disagree on the {key}: {[r[key] for r in every]}")
    out = {"dp": opts.dp, "tp": opts.tp, "pp": opts.pp, "world_size": dist.get_world_size(),
           "backend": dist.get_backend(), "model": opts.model, "schedule": hm.schedule,
           "data_parallel": opts.data_parallel, "microbatches": opts.microbatches, "dtype": opts.dtype, "mixed_precision": opts.mixed_precision,
           "start_step": first, "losses": losses, "all_losses": before + losses,
           "step_ms": times, "tokens_per_step": batches[0].numel(),
           "model_param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
           "param_bytes_per_rank": [r["param_bytes"] for r in every],
           "peak_rss_bytes_per_rank": [r["peak_rss_bytes"] for r in every],
           "stages_per_rank": [r["stages"] for r in every], "setup_s": round(setup_s, 3), "step_s": round(step_s, 4)}
    if hm.scaler is not None:
        out["skipped_steps"] = hm.scaler.skipped
    return {**out, "grad_norms": norms} if opts.clip else out


def _peak_bytes() -> int:
    """This process's peak memory: GPU memory allocated on CUDA, else the peak resident set size."""
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def main() -> None:
    """Parse the flags; the reference in a plain process, one rank of the hybrid run under torchrun."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for dim in ("dp", "tp", "pp"):
        parser.add_argument(f"--{dim}", type=int, default=1, help=f"{dim} degree of the mesh")
    parser.add_argument("--model", default="gpt", help="file.py:NAME, pkg.mod:NAME, gpt, hf:<model_type>")
    parser.add_argument("--config", action="append", metavar="KEY=VALUE", help="model config override (repeatable)")
    parser.add_argument("--layers", type=int, default=None, help="the model's depth (n_layer / num_hidden_layers)")
    parser.add_argument("--inputs", default="8x16:long", help="the global batch, BxT:long")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--microbatches", type=int, default=None, help="default: pp")
    parser.add_argument("--schedule", default="1F1B", help="1F1B, Interleaved1F1B or GPipe")
    parser.add_argument("--data-parallel", default="fsdp", choices=("fsdp", "ddp"))
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--clip", type=float, default=None, help="clip gradients to this global norm each step")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    parser.add_argument("--mixed-precision", default=None, choices=("bf16", "fp16"),
                        help="compute in bfloat16 / float16 with float32 weights, optimizer state and gradient "
                             "reductions (fp16 with a loss scaler); the reference runs the same policy")
    parser.add_argument("--seed", type=int, default=0, help="seed of the batches")
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--save", default=None, help="write a DCP checkpoint here after training")
    parser.add_argument("--load", default=None, help="start from this DCP checkpoint's weights (saved at any layout)")
    parser.add_argument("--checkpoint-dir", default=None, metavar="D",
                        help="resume from the latest complete checkpoint in D; with --save-every, save there")
    parser.add_argument("--save-every", type=int, default=None, metavar="N",
                        help="save the whole training state to D/step_<n> every N steps")
    parser.add_argument("--keep", type=int, default=None, metavar="K", help="keep the newest K checkpoints in D")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    opts = parser.parse_args()
    if opts.save_every is not None and not (opts.checkpoint_dir and opts.save_every >= 1):
        parser.error("--save-every N needs --checkpoint-dir D and N >= 1")
    if opts.keep is not None and not (opts.save_every and opts.keep >= 1):
        parser.error("--keep K needs --save-every N and K >= 1")
    opts.microbatches = opts.microbatches or opts.pp
    launched = "RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ
    if not launched and opts.dp * opts.tp * opts.pp == 1:
        report = reference(opts)
    else:
        owned = not dist.is_initialized()
        report = distributed(opts)
        rank = dist.get_rank()
        tpcompile.runtime.shutdown(destroy=owned)  # barrier: no rank tears the group down while another still uses it
        if rank != 0:
            return
    times, tokens = report.pop("step_ms"), report.pop("tokens_per_step")  # the lines' figures, not the JSON's
    if opts.json:
        print(json.dumps(report))
    else:  # one line per step: the global batch's loss, rank 0's time, the global batch's tokens per second
        for step, (loss, ms) in enumerate(zip(report["losses"], times)):
            print(f"step {step:>3}  loss {loss:.6f}  {ms:.1f} ms  {tokens / (ms / 1e3):.0f} tokens/s")


if __name__ == "__main__":
    from tpcompile.cli.script import run_script
    raise SystemExit(run_script(main))  # a user error: one line from rank 0, exit 2
