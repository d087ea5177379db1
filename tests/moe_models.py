"""Small Llama-style mixture-of-experts models in the layouts real code uses, for the MoE and fuzz tests.

Experts are either a ModuleList of SwiGLU MLPs (Mixtral's original code, DeepSpeed) or fused 3-D
weights (`w13` (experts, 2 * inner, width) and `w2` (experts, width, inner), as transformers 5 and
vLLM store them) applied by bmm on the weights gathered per token (`w13[ids]`), by einsum over
every expert, one expert at a time (`w13[e]`), or on the tokens grouped by expert, the experts'
outputs joined by token before gate | up is chunked (ScatterMoE's layout, JetMoE's). The router
picks the top k experts per token; a shared expert (DeepSeek, Qwen2-MoE) runs on every token, gated
by a sigmoid in the Qwen style.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

LAYOUTS = ("list_dense", "list_sparse", "bmm", "einsum", "loop", "grouped")


@dataclass(frozen=True)
class MoEConfig:
    """One MoE model: sizes, the experts' layout and the shared expert."""

    vocab: int = 64
    width: int = 32
    heads: int = 4
    depth: int = 2
    experts: int = 4
    top_k: int = 2
    inner: int = 16  # each expert's hidden size
    layout: str = "list_dense"
    shared: int = 0  # the shared expert's hidden size (0: none)
    shared_gate: bool = False  # Qwen2-MoE: the shared expert's output scaled by sigmoid(gate(x))


class SwiGLU(nn.Module):
    """gate / up / down projections without bias."""

    def __init__(self, width: int, inner: int) -> None:
        super().__init__()
        self.gate = nn.Linear(width, inner, bias=False)
        self.up = nn.Linear(width, inner, bias=False)
        self.down = nn.Linear(inner, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class MoE(nn.Module):
    """Router, experts in one of LAYOUTS, optional shared expert; (B, T, width) -> (B, T, width)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.width, cfg.experts, bias=False)
        if cfg.layout.startswith("list"):
            self.experts = nn.ModuleList(SwiGLU(cfg.width, cfg.inner) for _ in range(cfg.experts))
        else:
            self.w13 = nn.Parameter(torch.randn(cfg.experts, 2 * cfg.inner, cfg.width) / cfg.width ** 0.5)
            self.w2 = nn.Parameter(torch.randn(cfg.experts, cfg.width, cfg.inner) / cfg.inner ** 0.5)
        if cfg.shared:
            self.shared = SwiGLU(cfg.width, cfg.shared)
            if cfg.shared_gate:
                self.shared_gate = nn.Linear(cfg.width, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        B, T, D = x.shape
        h = x.reshape(-1, D)
        weights, ids = torch.topk(self.router(h).softmax(-1), cfg.top_k, dim=-1)  # (N, k)
        weights = weights / weights.sum(-1, keepdim=True)
        dense = torch.zeros(h.shape[0], cfg.experts, dtype=h.dtype).scatter(1, ids, weights)  # (N, E)
        out = getattr(self, f"_{cfg.layout}")(h, ids, weights, dense)
        if cfg.shared:
            s = self.shared(h)
            out = out + (torch.sigmoid(self.shared_gate(h)) * s if cfg.shared_gate else s)
        return out.reshape(B, T, D)

    def _list_dense(self, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            out = out + expert(h) * dense[:, e:e + 1]
        return out

    def _list_sparse(self, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):  # only the tokens routed to e (Mixtral's loop)
            tok, slot = torch.where(ids == e)
            out = out.index_add(0, tok, expert(h[tok]) * w[tok, slot, None])
        return out

    def _bmm(self, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)  # (N * k,)
        xs = h.repeat_interleave(self.cfg.top_k, dim=0)  # each token once per chosen expert
        gate, up = torch.bmm(xs.unsqueeze(1), self.w13[flat].transpose(1, 2)).squeeze(1).chunk(2, dim=-1)
        y = torch.bmm(self.w2[flat], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)  # (N * k, D)
        return (y * w.reshape(-1, 1)).view(h.shape[0], self.cfg.top_k, -1).sum(1)

    def _einsum(self, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        gate, up = torch.einsum("nd,efd->nef", h, self.w13).chunk(2, dim=-1)  # every expert on every token
        y = torch.einsum("nef,edf->ned", F.silu(gate) * up, self.w2)
        return torch.einsum("ned,ne->nd", y, dense)

    def _loop(self, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(h)
        for e in range(self.cfg.experts):  # one expert at a time, indexed out of the fused weights
            gate, up = F.linear(h, self.w13[e]).chunk(2, dim=-1)
            out = out + F.linear(F.silu(gate) * up, self.w2[e]) * dense[:, e:e + 1]
        return out

    def _grouped(self, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        order = ids.reshape(-1).argsort(stable=True)  # (token, slot) pairs grouped by expert
        tok = order // self.cfg.top_k
        sizes = (dense > 0).long().sum(0).tolist()  # tokens per expert
        parts = h[tok].split(sizes, dim=0)
        hid = torch.cat([F.linear(p, self.w13[e]) for e, p in enumerate(parts)], dim=0)  # all experts, by token
        gate, up = hid.chunk(2, dim=-1)
        acts = (F.silu(gate) * up).split(sizes, dim=0)
        y = torch.cat([F.linear(a, self.w2[e]) for e, a in enumerate(acts)], dim=0)
        return torch.zeros_like(h).index_add(0, tok, y * w.reshape(-1)[order, None])


class Block(nn.Module):
    """RMSNorm, causal attention, RMSNorm, MoE, with residuals."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.norm1, self.norm2 = nn.RMSNorm(cfg.width), nn.RMSNorm(cfg.width)
        self.q, self.k, self.v, self.o = (nn.Linear(cfg.width, cfg.width, bias=False) for _ in range(4))
        self.moe = MoE(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).view(B, T, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D)
        x = x + self.o(a)
        return x + self.moe(self.norm2(x))


class MoEModel(nn.Module):
    """Token embedding, `depth` blocks, final norm, head: (B, T) token ids -> (B, T, vocab) logits."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.norm = nn.RMSNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_moe(seed: int = 0, **kw: object) -> MoEModel:
    """The model with a fixed seed, in eval mode."""
    torch.manual_seed(seed)
    return MoEModel(MoEConfig(**kw)).eval()  # type: ignore[arg-type]
