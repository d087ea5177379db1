"""`python -m bench.precision_memory`: bytes per rank of a training step with and without mixed precision.

The bundled GPT (4 layers, width 256, 8 heads) trained by parallelize_train on 2 gloo ranks at (dp, tp, pp)
= (2, 1, 1) and (1, 2, 1), float32 and `mixed_precision="bf16"`, batch 8 x 64 tokens. Per rank, after two
AdamW steps: the parameters held (FSDP shards of the float32 masters), their gradients, AdamW's state, the
bytes saved for backward during a step (torch.autograd.graph.saved_tensors_hooks around HybridModel.step:
activations in the compute dtype, and the bf16 copies of gathered weights the matmuls keep), and the bytes
FSDP all-gathers and reduce-scatters per step. Writes bench/results/precision_memory.json and replaces the
table between the markers in docs/hybrid.md.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "precision_memory.json"
DOC = ROOT / "docs" / "hybrid.md"
CONFIG = dict(vocab_size=256, block_size=64, n_layer=4, n_head=8, n_embd=256)
LAYOUTS = ({"dp": 2}, {"tp": 2})


def _tensor_bytes(ts: Any) -> int:
    seen: dict[int, torch.Tensor] = {}
    for t in ts:
        local = t.to_local() if hasattr(t, "to_local") else t
        seen[id(local)] = local
    return sum(t.numel() * t.element_size() for t in seen.values())


def _rank(rank: int) -> list[dict]:
    import torch.distributed as dist
    import torch.nn.functional as F

    import tpcompile
    from tpcompile.models import GPT, GPTConfig
    torch.set_num_threads(1)

    def loss_fn(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    rows = []
    for dims in LAYOUTS:
        for policy in (None, "bf16"):
            torch.manual_seed(0)
            model = GPT(GPTConfig(**CONFIG)).train()
            ids = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(1))
            mesh = tpcompile.init_mesh(**dims)
            dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
            mine = ids[dp_rank * 8 // dp:(dp_rank + 1) * 8 // dp]
            hm = tpcompile.parallelize_train(model, mesh, loss_fn=loss_fn, example_inputs=(mine,),
                                             mixed_precision=policy)
            opt = torch.optim.AdamW(hm.parameters(), lr=1e-3)
            moved = {"all_gather": 0, "reduce_scatter": 0}
            saved_fns = dist.all_gather_single, dist.reduce_scatter_single

            def count(kind: str, fn: Any) -> Any:
                def wrapped(*a: Any, **k: Any) -> Any:
                    if kind == "all_gather":
                        t = k["output"] if "output" in k else a[0]
                    else:
                        t = k["input"] if "input" in k else a[1]
                    moved[kind] += t.numel() * t.element_size()
                    return fn(*a, **k)
                return wrapped
            kept: list[int] = []
            for step in range(2):
                opt.zero_grad()
                if step == 1:
                    dist.all_gather_single = count("all_gather", saved_fns[0])
                    dist.reduce_scatter_single = count("reduce_scatter", saved_fns[1])
                with torch.autograd.graph.saved_tensors_hooks(
                        lambda t: (kept.append(t.numel() * t.element_size()) if step == 1 else None) or t,
                        lambda t: t):
                    hm.step(mine, target=mine)
                opt.step()
            dist.all_gather_single, dist.reduce_scatter_single = saved_fns
            params = list(hm.parameters())
            state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
            rows.append({"layout": "x".join(str(dims.get(d, 1)) for d in ("dp", "tp", "pp")),
                         "mixed_precision": policy or "-", "params": _tensor_bytes(params),
                         "grads": _tensor_bytes(p.grad for p in params if p.grad is not None),
                         "optimizer": _tensor_bytes(state), "saved_for_backward": sum(kept),
                         "fsdp_all_gather": moved["all_gather"], "fsdp_reduce_scatter": moved["reduce_scatter"]})
    return rows


def table(rows: list[dict]) -> str:
    """The markdown table of the rank-0 rows."""
    kib = lambda n: f"{n / 1024:,.0f}"  # noqa: E731
    out = ["| (dp, tp, pp) | mixed precision | parameters | gradients | AdamW state | saved for backward | "
           "FSDP all-gather / step | FSDP reduce-scatter / step |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| ({r['layout'].replace('x', ', ')}) | {r['mixed_precision']} | {kib(r['params'])} | "
                   f"{kib(r['grads'])} | {kib(r['optimizer'])} | {kib(r['saved_for_backward'])} | "
                   f"{kib(r['fsdp_all_gather'])} | {kib(r['fsdp_reduce_scatter'])} |")
    return "\n".join(out) + "\n\nKiB per rank (rank 0; the other rank holds the same)."


def main() -> int:
    from tpcompile.runtime.launch import launch
    per_rank = launch(2, _rank, timeout=900)
    RESULTS.write_text(json.dumps({"config": CONFIG, "ranks": per_rank}, indent=1) + "\n")
    text = table(per_rank[0])
    print(text)
    doc = DOC.read_text()
    new = re.sub(r"(<!-- precision-memory:start -->\n).*?(<!-- precision-memory:end -->)",
                 lambda m: m.group(1) + text + "\n" + m.group(2), doc, flags=re.S)
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
