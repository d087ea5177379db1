"""A parallel-block transformer (attention and MLP read the same normed input, their outputs summed,
as GPT-J and PaLM do) and its hand-written Megatron-style tensor-parallel split.

The hand-written rank: one `copy` of the normed input shared by both branches (its gradient
all-reduced once in backward), q/k/v column split by whole heads, MLP fc column split, the two
row-split outputs each all-reduced in place in forward (bias after), as Megatron's
RowParallelLinear does: the same collectives, bytes and order tpcompile emits for this model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bench.megatron_comm import CommLog

__all__ = ["ParallelBlockNet", "TPParallelBlockNet"]


class ParallelBlock(nn.Module):
    """x + attention(ln(x)) + mlp(ln(x))."""

    def __init__(self, d: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln = nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.fc, self.proj = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def attention(self, h: torch.Tensor) -> torch.Tensor:
        b, t, _ = h.shape
        q, k, v = (p(h).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hd)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))

    @property
    def head_dim(self) -> int:
        return self.q.in_features // self.heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        return x + self.attention(h) + self.proj(F.gelu(self.fc(h)))


class ParallelBlockNet(nn.Module):
    """`layers` parallel blocks of width d."""

    def __init__(self, d: int = 256, heads: int = 8, hidden: int = 1024, layers: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ParallelBlock(d, heads, hidden) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _chunk(t: torch.Tensor, dim: int, rank: int, ws: int) -> nn.Parameter:
    n = t.shape[dim] // ws
    return nn.Parameter(t.detach().narrow(dim, rank * n, n).clone())


class _TPBlock(nn.Module):
    def __init__(self, src: ParallelBlock, rank: int, ws: int, comm: CommLog) -> None:
        super().__init__()
        self.comm, self.heads, self.head_dim = comm, src.heads // ws, src.head_dim
        self.ln = nn.LayerNorm(src.ln.normalized_shape)
        self.ln.load_state_dict(src.ln.state_dict())
        self.wq, self.wk, self.wv, self.wfc = (_chunk(m.weight, 0, rank, ws) for m in (src.q, src.k, src.v, src.fc))
        self.bq, self.bk, self.bv, self.bfc = (_chunk(m.bias, 0, rank, ws) for m in (src.q, src.k, src.v, src.fc))
        self.wo, self.wproj = _chunk(src.o.weight, 1, rank, ws), _chunk(src.proj.weight, 1, rank, ws)
        self.bo, self.bproj = nn.Parameter(src.o.bias.detach().clone()), nn.Parameter(src.proj.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.comm.copy(self.ln(x))
        q, k, v = (F.linear(h, w, bias).view(b, t, self.heads, self.head_dim).transpose(1, 2)
                   for w, bias in ((self.wq, self.bq), (self.wk, self.bk), (self.wv, self.bv)))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        attn = self.comm.all_reduce(F.linear(y, self.wo)) + self.bo
        mlp = self.comm.all_reduce(F.linear(F.gelu(F.linear(h, self.wfc, self.bfc)), self.wproj)) + self.bproj
        return x + attn + mlp


class TPParallelBlockNet(nn.Module):
    """Rank `rank` of a world-size `ws` hand-written split of a ParallelBlockNet."""

    def __init__(self, model: ParallelBlockNet, rank: int, ws: int) -> None:
        super().__init__()
        self.comm = CommLog()
        self.blocks = nn.ModuleList(_TPBlock(b, rank, ws, self.comm) for b in model.blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x
