"""Greedy generation with the bundled GPT, tensor-parallel:

    torchrun --nproc-per-node 2 examples/generate.py --tokens 16
    python examples/generate.py                       # one rank, no torchrun needed

Every rank runs its shard of each forward; the logits come back whole on every rank, so all
ranks pick the same next token. Rank 0 prints the tokens and checks them against the
unsharded model's greedy choice. The bundled GPT is untrained (random weights), so greedy decoding
soon repeats one token over and over: that is the model, not the sharding; the check is that the
sharded ranks choose exactly what the unsharded model chooses.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import tpcompile
from tpcompile.models import build
from tpcompile.runtime import init_from_env


@torch.no_grad()
def greedy(model: torch.nn.Module, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """prompt (B, T) followed by n tokens, each the argmax of the last position's logits."""
    ids = prompt
    for _ in range(n):
        next_id = model(ids)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, next_id], dim=1)
    return ids


def main() -> None:
    """Parallelize over the launch's ranks (or run as one rank), generate, report from rank 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16, help="tokens to generate")
    parser.add_argument("--prompt-len", type=int, default=8)
    opts = parser.parse_args()
    owned = not dist.is_initialized()
    rank, world = init_from_env(standalone=True)
    model = build("gpt")
    if opts.prompt_len + opts.tokens > model.config.block_size:
        raise SystemExit(f"prompt + tokens must fit the block size {model.config.block_size}")
    local = tpcompile.parallelize(model, example_inputs=model.example_inputs())
    device = next(local.parameters()).device
    prompt = torch.randint(0, model.config.vocab_size, (1, opts.prompt_len),
                           generator=torch.Generator().manual_seed(0))
    out = greedy(local, prompt.to(device), opts.tokens).cpu()
    if rank == 0:
        print(f"world size {world} on {dist.get_backend()}: prompt {prompt[0].tolist()}")
        print(f"generated {out[0, opts.prompt_len:].tolist()}")
        same = torch.equal(out, greedy(model, prompt, opts.tokens))
        print("OK (same tokens as the unsharded model)" if same else "MISMATCH")
        print("(the bundled GPT is untrained, with random weights: greedy decoding repeating one token is the "
              "model, not the sharding)")
    dist.barrier()
    if owned:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
