"""Train the bundled GPT tensor-parallel and compare its losses with unsharded training.

    python examples/train_gpt.py                                  # 2 simulated ranks vs. unsharded
    python examples/train_gpt.py --world-size 1 --json            # unsharded only (the reference)
    torchrun --nproc-per-node 2 examples/train_gpt.py --json      # real ranks (gloo, or NCCL on GPUs)

Every run starts from the same weights and sees the same batches of a small synthetic dataset:
each sequence follows a fixed random successor table (token t is followed by succ[t]), so the
model can learn it and the loss falls quickly. Every rank keeps its own AdamW over its own
slice of the parameters; the loss is computed outside the model from the gathered logits.
"""

import argparse
import json
import os
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tpcompile
from tpcompile.cli.script import run_script
from tpcompile.models import build
from tpcompile.runtime import init_from_env, shutdown


def make_dataset(vocab: int, n_seq: int, length: int, seed: int = 0) -> torch.Tensor:
    """n_seq sequences of `length` tokens, each following one fixed successor table."""
    gen = torch.Generator().manual_seed(seed)
    succ = torch.randperm(vocab, generator=gen)
    data = torch.empty(n_seq, length, dtype=torch.long)
    data[:, 0] = torch.randint(0, vocab, (n_seq,), generator=gen)
    for t in range(1, length):
        data[:, t] = succ[data[:, t - 1]]
    return data


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of predicting token t+1 from positions <= t."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def setup(steps: int) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """The bundled GPT in training mode (dropout 0, so deterministic) and `steps` batches."""
    model = build("gpt").train()
    data = make_dataset(model.config.vocab_size, n_seq=64, length=32)
    return model, [data[(8 * i) % len(data):][:8] for i in range(steps)]


def step_line(step: int, loss: float, ms: float, tokens: int) -> str:
    """'step   3  loss 4.812345  41.2 ms  1553 tokens/s': one training step."""
    return f"step {step:>3}  loss {loss:.6f}  {ms:.1f} ms  {tokens / (ms / 1e3):.0f} tokens/s"


def train(model: torch.nn.Module, batches: list[torch.Tensor], lr: float,
          show: Optional[Callable[[str], None]] = None) -> list[float]:
    """AdamW steps of `model` (whole, or one rank's module) on the batches; the losses. With `show`, each step's
    line (step, loss, ms, tokens/s) is passed to it as the step ends."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    device = next(model.parameters()).device
    losses = []
    for step, ids in enumerate(batches):
        start = time.perf_counter()
        ids = ids.to(device)
        opt.zero_grad()
        loss = next_token_loss(model(ids), ids)
        loss.backward()
        opt.step()
        losses.append(loss.item())  # item() waits for the device, so the time is the step's
        if show is not None:
            show(step_line(step, losses[-1], (time.perf_counter() - start) * 1e3, ids.numel()))
    return losses


def reference_losses(steps: int = 20, lr: float = 3e-3) -> list[float]:
    """Unsharded training: the losses every sharded run should reproduce."""
    model, batches = setup(steps)
    return train(model, batches, lr)


def run_distributed(opts: argparse.Namespace) -> None:
    """One rank of a torchrun launch: parallelize, train, check the ranks agree, report from rank 0."""
    owned = not dist.is_initialized()
    rank, world = init_from_env()
    model, batches = setup(opts.steps)
    local = tpcompile.parallelize(model, example_inputs=(batches[0],))
    show = (lambda line: print(line, flush=True)) if rank == 0 and not opts.json else None
    losses = train(local, batches, opts.lr, show)
    every: list = [None] * world
    dist.all_gather_object(every, losses)
    if any(lo != losses for lo in every):
        raise SystemExit(f"the ranks disagree on the losses: {every}")
    if rank == 0:
        if opts.json:
            print(json.dumps({"world_size": world, "backend": dist.get_backend(), "losses": losses}))
    shutdown(destroy=owned)  # barrier: no rank tears the group down while another still uses it


def run_local(opts: argparse.Namespace) -> None:
    """Without torchrun: unsharded training, and (world size > 1) simulated ranks beside it."""
    ws = opts.world_size
    start = time.perf_counter()
    if ws == 1:
        model, batches = setup(opts.steps)
        ref = train(model, batches, opts.lr, None if opts.json else print)
        if opts.json:
            print(json.dumps({"world_size": 1, "losses": ref}))
        return
    ref = reference_losses(opts.steps, opts.lr)
    model, batches = setup(opts.steps)
    sharded = tpcompile.shard(model, ws, example_inputs=(batches[0],))
    ranks = [sharded.rank(r) for r in range(ws)]  # build every rank graph before the threads start
    lines: list[str] = []  # rank 0's step lines, printed after the table's header
    per_rank = tpcompile.simulate_ranks(
        ws, lambda r: train(ranks[r], batches, opts.lr, lines.append if r == 0 else None))
    if any(lo != per_rank[0] for lo in per_rank):
        raise SystemExit(f"the ranks disagree on the losses: {per_rank}")
    if opts.json:
        print(json.dumps({"world_size": ws, "losses": per_rank[0], "reference": ref}))
        return
    print(f"sharded steps (rank 0 of {ws} simulated ranks, which share this process):")
    print("\n".join(lines))
    print(f"\n{'step':>4}  {'unsharded':>10}  {'sharded':>10}  {'rel diff':>9}")
    worst = 0.0
    for step, (want, got) in enumerate(zip(ref, per_rank[0])):
        rel = abs(got - want) / abs(want)
        worst = max(worst, rel)
        print(f"{step:>4}  {want:>10.6f}  {got:>10.6f}  {rel:>9.2e}")
    print(f"\nmax relative loss difference over {len(ref)} steps at {ws} simulated ranks: {worst:.2e} "
          f"(every rank reports the same loss); total {time.perf_counter() - start:.1f} s")


def main() -> None:
    """Under torchrun, one rank of the real run; otherwise the local comparison."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--world-size", type=int, default=2, help="simulated ranks (ignored under torchrun)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--json", action="store_true", help="print the losses as one JSON line")
    opts = parser.parse_args()
    if "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ:
        run_distributed(opts)
    else:
        run_local(opts)


if __name__ == "__main__":
    raise SystemExit(run_script(main))  # a user error: one line from rank 0, exit 2
