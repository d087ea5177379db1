"""Train the bundled GPT unsharded and sharded across 2 simulated ranks, and compare the losses.

Both runs start from the same weights and see the same batches of a small synthetic dataset:
each sequence follows a fixed random successor table (token t is followed by succ[t]), so
the model can learn it and the loss falls quickly. Every rank keeps its own AdamW over its
own slice of the parameters; the loss is computed outside the model from the gathered logits.
"""

import argparse
import copy
import time

import torch
import torch.nn.functional as F

import tpcompile
from tpcompile.models import build


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


def main() -> None:
    """Train both ways, print the two loss curves side by side and their largest difference."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    opts = parser.parse_args()
    ws = opts.world_size

    model = build("gpt").train()  # dropout is 0, so training is deterministic
    data = make_dataset(model.config.vocab_size, n_seq=64, length=32)
    batches = [data[(8 * i) % len(data):][:8] for i in range(opts.steps)]

    start = time.perf_counter()
    sharded = tpcompile.shard(model, ws, example_inputs=(batches[0],))
    ranks = [sharded.rank(r) for r in range(ws)]  # build every rank graph before the threads start
    print(f"sharded over {ws} ranks in {time.perf_counter() - start:.1f} s; "
          f"rank 0 holds {sum(p.numel() for p in ranks[0].parameters()):,} of "
          f"{sum(p.numel() for p in model.parameters()):,} parameters")

    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(reference.parameters(), lr=opts.lr)
    ref_losses = []
    for ids in batches:
        opt.zero_grad()
        loss = next_token_loss(reference(ids), ids)
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())

    rank_opts = [torch.optim.AdamW(gm.parameters(), lr=opts.lr) for gm in ranks]
    rank_losses: list[list[float]] = [[] for _ in range(ws)]

    def train_step(ids: torch.Tensor):
        def run(r: int) -> None:
            rank_opts[r].zero_grad()
            loss = next_token_loss(ranks[r](ids), ids)
            loss.backward()
            rank_opts[r].step()
            rank_losses[r].append(loss.item())
        return run

    for ids in batches:
        tpcompile.simulate_ranks(ws, train_step(ids))

    print(f"\n{'step':>4}  {'unsharded':>10}  {'sharded':>10}  {'rel diff':>9}")
    worst = 0.0
    for step, want in enumerate(ref_losses):
        got = rank_losses[0][step]
        if any(losses[step] != got for losses in rank_losses):
            raise SystemExit(f"step {step}: the ranks disagree on the loss: {[lo[step] for lo in rank_losses]}")
        rel = abs(got - want) / abs(want)
        worst = max(worst, rel)
        print(f"{step:>4}  {want:>10.6f}  {got:>10.6f}  {rel:>9.2e}")
    print(f"\nmax relative loss difference over {len(batches)} steps: {worst:.2e} "
          f"(every rank reports the same loss); total {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
