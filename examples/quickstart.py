"""Shard the bundled GPT across 2 ranks, simulate them and compare with the original model."""

import torch

import tpcompile
from tpcompile.models import GPT, GPTConfig


def main() -> None:
    """Build, shard, simulate, compare and print the plan summary."""
    torch.manual_seed(0)
    model = GPT(GPTConfig()).eval()
    idx = torch.randint(0, model.config.vocab_size, (2, 16))

    sharded = tpcompile.shard(model, 2, example_inputs=(idx,))
    print(sharded.summary())

    with torch.no_grad():
        expected = model(idx)
        outputs = tpcompile.simulate(sharded, idx)
    for rank, logits in enumerate(outputs):
        diff = (logits - expected).abs().max().item()
        print(f"rank {rank}: logits {tuple(logits.shape)}, max |diff| vs unsharded {diff:.2e}")
        if diff > 1e-5:
            raise SystemExit(f"rank {rank} differs from the unsharded model by {diff:.2e}")

    # Shapes were captured as dynamic, so another batch and sequence length works unchanged.
    longer = torch.randint(0, model.config.vocab_size, (3, 32))
    with torch.no_grad():
        diff = max((out - model(longer)).abs().max().item() for out in tpcompile.simulate(sharded, longer))
    print(f"batch 3, length 32: max |diff| {diff:.2e}")


if __name__ == "__main__":
    main()
