"""Shard a stack of Linear layers across 4 ranks and count the collectives each rank runs."""

from collections import Counter

import torch

import tpcompile
from tpcompile.models import MLPStack


def main() -> None:
    """Shard, look at rank 0's graph, simulate and compare with the original model."""
    torch.manual_seed(0)
    model = MLPStack(dims=(64, 256, 64, 256, 64), activation="gelu").eval()
    x = torch.randn(8, 64)

    sharded = tpcompile.shard(model, 4, example_inputs=(x,))
    print(sharded.summary())

    rank0 = sharded.rank(0)
    ops = Counter(
        str(node.target)
        for node in rank0.graph.nodes
        if node.op == "call_function" and getattr(node.target, "namespace", None) == "tpcompile"
    )
    print(f"collectives in rank 0's graph: {dict(ops) or 'none'}")

    with torch.no_grad():
        expected = model(x)
        diffs = [(out - expected).abs().max().item() for out in tpcompile.simulate(sharded, x)]
    print("max |diff| per rank: " + ", ".join(f"{d:.2e}" for d in diffs))
    if max(diffs) > 1e-5:
        raise SystemExit(f"a rank differs from the unsharded model by {max(diffs):.2e}")


if __name__ == "__main__":
    main()
