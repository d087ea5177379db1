"""A hand-written Megatron-style tensor-parallel GPT, the baseline tpcompile is measured against.

Each rank holds its own slices of the bundled GPT's weights:

* attention ``c_attn``: column split, taken per q/k/v segment so each rank owns whole heads;
* attention ``c_proj`` and MLP ``c_proj``: row split, partial sums all-reduced, bias added after;
* MLP ``c_fc``: column split;
* token embedding: vocab-parallel (out-of-range ids masked, rows zeroed, then all-reduced);
* ``lm_head``: column (vocab) split, sharing the embedding slice when the weights are tied,
  with the logits all-gathered along the vocabulary.

Forward and backward (Megatron's conjugate collectives, bench/megatron_comm.py); dropout is
skipped. The collectives run on torch.distributed's default group; every call is logged as
(op, bytes of this rank's input) in ``comm``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tpcompile.models.gpt import GPT, Block, CausalSelfAttention

from bench.megatron_comm import CommLog

__all__ = ["TPGPT", "CommLog"]


def _chunk(t: torch.Tensor, dim: int, rank: int, ws: int) -> torch.Tensor:
    """Rank's contiguous equal chunk of t along dim, copied into its own storage."""
    if t.shape[dim] % ws:
        raise ValueError(f"size {t.shape[dim]} of dim {dim} is not divisible by world size {ws}")
    n = t.shape[dim] // ws
    return t.detach().narrow(dim, rank * n, n).clone()


def _segments(t: torch.Tensor, parts: int, rank: int, ws: int) -> torch.Tensor:
    """Rank's chunk of each of `parts` equal segments of t along dim 0, concatenated."""
    return torch.cat([_chunk(s, 0, rank, ws) for s in t.detach().chunk(parts, dim=0)], dim=0)


def _param(t: torch.Tensor | None) -> nn.Parameter | None:
    """t as a trainable Parameter (None stays None)."""
    return None if t is None else nn.Parameter(t.contiguous())


class ColumnLinear(nn.Module):
    """y = x W_r^T + b_r with this rank's output rows (already sliced); no communication."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Hold the local weight and bias."""
        super().__init__()
        self.weight = _param(weight)
        self.bias = _param(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Local slice of the output features."""
        return F.linear(x, self.weight, self.bias)


class RowLinear(nn.Module):
    """y = all_reduce(x_r W_r^T) + b: input features split, bias added once after the sum."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, comm: CommLog) -> None:
        """Hold the local weight columns and the full bias."""
        super().__init__()
        self.weight = _param(weight)
        self.bias = _param(bias)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Partial product, summed over ranks, plus the bias."""
        y = self.comm.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class TPAttention(nn.Module):
    """Causal self-attention over this rank's n_head / world_size heads."""

    def __init__(self, src: CausalSelfAttention, rank: int, ws: int, comm: CommLog) -> None:
        """Slice q/k/v per segment (column) and the output projection (row)."""
        super().__init__()
        if src.n_head % ws:
            raise ValueError(f"n_head {src.n_head} is not divisible by world size {ws}")
        self.local_heads = src.n_head // ws
        self.head_dim = src.n_embd // src.n_head
        self.attention = src.attention
        # The model's own matmuls, sliced: one fused q|k|v matmul, or three when the model has three.
        if src.fused_qkv:
            w = _segments(src.c_attn.weight, 3, rank, ws)
            b = None if src.c_attn.bias is None else _segments(src.c_attn.bias, 3, rank, ws)
            self.qkv = nn.ModuleList([ColumnLinear(w, b)])
        else:
            self.qkv = nn.ModuleList([
                ColumnLinear(_chunk(p.weight, 0, rank, ws), None if p.bias is None else _chunk(p.bias, 0, rank, ws))
                for p in (src.q_proj, src.k_proj, src.v_proj)])
        proj_b = None if src.c_proj.bias is None else src.c_proj.bias.detach().clone()
        self.c_proj = RowLinear(_chunk(src.c_proj.weight, 1, rank, ws), proj_b, comm)
        self.comm = comm
        if src.attention == "manual":
            self.register_buffer("causal_mask", src.causal_mask.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) replicated -> (B, T, C) replicated, one all_reduce."""
        B, T, _ = x.shape
        width = self.local_heads * self.head_dim
        x = self.comm.copy(x)
        if len(self.qkv) == 1:
            q, k, v = self.qkv[0](x).split(width, dim=2)
        else:
            q, k, v = (proj(x) for proj in self.qkv)
        q = q.view(B, T, self.local_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.local_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.local_heads, self.head_dim).transpose(1, 2)
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.causal_mask[:, :, :T, :T] == 0, float("-inf"))
            y = F.softmax(att, dim=-1) @ v
        y = y.transpose(1, 2).contiguous().view(B, T, width)
        return self.c_proj(y)


class TPMLP(nn.Module):
    """Column c_fc, GELU, row c_proj: one all_reduce."""

    def __init__(self, src: nn.Module, rank: int, ws: int, comm: CommLog) -> None:
        """Slice c_fc by output rows and c_proj by input columns."""
        super().__init__()
        fc_b = None if src.c_fc.bias is None else _chunk(src.c_fc.bias, 0, rank, ws)
        self.c_fc = ColumnLinear(_chunk(src.c_fc.weight, 0, rank, ws), fc_b)
        proj_b = None if src.c_proj.bias is None else src.c_proj.bias.detach().clone()
        self.c_proj = RowLinear(_chunk(src.c_proj.weight, 1, rank, ws), proj_b, comm)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) replicated -> (B, T, C) replicated."""
        return self.c_proj(F.gelu(self.c_fc(self.comm.copy(x))))


class TPBlock(nn.Module):
    """Pre-norm block with replicated layer norms around the parallel attention and MLP."""

    def __init__(self, src: Block, rank: int, ws: int, comm: CommLog) -> None:
        """Copy the norms, slice attention and MLP."""
        super().__init__()
        self.ln_1 = _copy_norm(src.ln_1)
        self.attn = TPAttention(src.attn, rank, ws, comm)
        self.ln_2 = _copy_norm(src.ln_2)
        self.mlp = TPMLP(src.mlp, rank, ws, comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Residual attention then residual MLP."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def _copy_norm(src: nn.LayerNorm) -> nn.LayerNorm:
    """A copy of a layer norm (replicated on every rank)."""
    ln = nn.LayerNorm(src.normalized_shape, eps=src.eps, bias=src.bias is not None)
    ln.load_state_dict(src.state_dict())
    return ln


class TPGPT(nn.Module):
    """Rank `rank` of a world-size `ws` Megatron-style split of a bundled GPT."""

    def __init__(self, model: GPT, rank: int, ws: int) -> None:
        """Slice every weight of `model` for this rank; model itself is left untouched."""
        super().__init__()
        cfg = model.config
        if cfg.vocab_size % ws:
            raise ValueError(f"vocab_size {cfg.vocab_size} is not divisible by world size {ws}")
        self.rank, self.ws = rank, ws
        self.block_size = cfg.block_size
        self.comm = CommLog()
        self.vocab_local = cfg.vocab_size // ws
        self.vocab_start = rank * self.vocab_local
        self.wte = _param(_chunk(model.transformer.wte.weight, 0, rank, ws))
        self.wpe = _param(model.transformer.wpe.weight.detach().clone())
        self.h = nn.ModuleList([TPBlock(b, rank, ws, self.comm) for b in model.transformer.h])
        self.ln_f = _copy_norm(model.transformer.ln_f)
        if model.lm_head.weight is model.transformer.wte.weight:
            self.lm_head = self.wte  # tied: the embedding's vocab slice is the head's column slice
        else:
            self.lm_head = _param(_chunk(model.lm_head.weight, 0, rank, ws))

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: rows of other ranks' ids are zero here, then summed."""
        local = idx - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_local)
        emb = F.embedding(local.masked_fill(outside, 0), self.wte)
        emb = emb.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.comm.all_reduce(emb)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> full logits (B, T, vocab_size) on every rank."""
        T = idx.shape[1]
        if T > self.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.block_size}")
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.embed(idx) + F.embedding(pos, self.wpe)
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        return self.comm.all_gather_last(F.linear(self.comm.copy(x), self.lm_head))

    def parameter_bytes(self) -> int:
        """Bytes of the distinct parameter tensors this rank holds."""
        return sum(p.numel() * p.element_size() for p in self.parameters())
