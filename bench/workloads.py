"""The benchmarked models: their weights, inputs, loss and the equivalent hand-made TP plans."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from tpcompile.models import GPT, GPTConfig
from tpcompile.models.mlp import MLPStack

__all__ = ["WORKLOADS", "Workload", "gpt_workload", "mlp_workload"]


@dataclass
class Workload:
    """A model built the same way in every process, with its batch, loss and TP plans."""

    name: str
    describe: str
    build: Callable[[], nn.Module]
    inputs: Callable[[], tuple]
    loss: Callable[[torch.Tensor, tuple], torch.Tensor]
    # module path -> "colwise" | "rowwise" | "vocab" (embedding rows) | "colwise_gather" (output gathered)
    plan: dict[str, str]
    config: dict[str, Any] = field(default_factory=dict)


def mlp_workload(width: int = 512, hidden: int = 2048, pairs: int = 4, batch: tuple = (4, 128)) -> Workload:
    """`pairs` blocks of width -> hidden -> width Linear layers, GELU between every two."""
    dims = (width, hidden) * pairs + (width,)

    def build() -> nn.Module:
        torch.manual_seed(0)
        return MLPStack(dims).eval()

    def inputs() -> tuple:
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(*batch, width, generator=gen)
        return (x,)

    def loss(out: torch.Tensor, _inputs: tuple) -> torch.Tensor:
        # Regression to ones: a loss near 1 whose first SGD steps change it visibly.
        return (out - 1.0).square().mean()

    plan = {f"layers.{2 * i}": ("colwise" if i % 2 == 0 else "rowwise") for i in range(2 * pairs)}
    describe = (f"`MLPStack({dims})` ({pairs} blocks of {width}->{hidden}->{width} Linear, GELU between"
                f" consecutive layers), input {tuple(batch) + (width,)}, loss mean((out - 1)**2)")
    return Workload("mlp", describe, build, inputs, loss, plan, dict(dims=list(dims), batch=list(batch)))


def gpt_workload(vocab: int = 1024, block: int = 128, layers: int = 4, heads: int = 8, embd: int = 256,
                 batch: tuple = (4, 128)) -> Workload:
    """The bundled GPT with separate q/k/v projections and an untied LM head."""
    cfg = dict(vocab_size=vocab, block_size=block, n_layer=layers, n_head=heads, n_embd=embd,
               fused_qkv=False, tie_weights=False)

    def build() -> nn.Module:
        torch.manual_seed(0)
        return GPT(GPTConfig(**cfg)).eval()

    def inputs() -> tuple:
        gen = torch.Generator().manual_seed(1)
        return (torch.randint(0, vocab, tuple(batch), generator=gen),)

    def loss(logits: torch.Tensor, inputs: tuple) -> torch.Tensor:
        # Next-token prediction on the batch itself.
        idx = inputs[0]
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))

    plan: dict[str, str] = {"transformer.wte": "vocab", "lm_head": "colwise_gather"}
    for i in range(layers):
        p = f"transformer.h.{i}"
        plan.update({f"{p}.attn.q_proj": "colwise", f"{p}.attn.k_proj": "colwise",
                     f"{p}.attn.v_proj": "colwise", f"{p}.attn.c_proj": "rowwise",
                     f"{p}.mlp.c_fc": "colwise", f"{p}.mlp.c_proj": "rowwise"})
    text = ", ".join(f"{k}={v}" for k, v in cfg.items())
    describe = (f"bundled `GPT(GPTConfig({text}))` (sdpa attention, bias, dropout 0), token ids"
                f" {tuple(batch)}, loss next-token cross entropy")
    return Workload("gpt", describe, build, inputs, loss, plan, dict(cfg, batch=list(batch)))


# Factories by name: rank processes rebuild a workload from (name, kwargs), which pickle.
WORKLOADS: dict[str, Callable[..., Workload]] = {"mlp": mlp_workload, "gpt": gpt_workload}
