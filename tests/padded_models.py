"""Models whose widths, heads or channels the world sizes of tests/test_padded_ops.py do not divide: each one case
of a zero-padded split going through an op (a norm, attention, a reduction, a reshape, an op without a rule).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class NormedMLP(torch.nn.Module):
    """up -> gelu -> LayerNorm over the up projection's 100 features -> down (a masked-LM head's transform)."""

    def __init__(self, affine: bool = True) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(32, 100), torch.nn.Linear(100, 32)
        self.ln = torch.nn.LayerNorm(100, elementwise_affine=affine)
        if affine:
            with torch.no_grad():
                self.ln.weight.normal_()
                self.ln.bias.normal_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.ln(F.gelu(self.up(x))))


class SubNormAttention(torch.nn.Module):
    """4 heads, their output normalised (RMS, written out) over the heads' features before the output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(3))
        self.o = torch.nn.Linear(32, 32)
        self.scale = torch.nn.Parameter(torch.rand(32) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, 4, 8).transpose(1, 2) for p in self.qkv)
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, 32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.scale
        return self.o(h)


class GatedAttention(torch.nn.Module):
    """4 heads whose merged output is gated elementwise by a projection of the input (no heads of its own)."""

    def __init__(self, normed: bool = False) -> None:
        super().__init__()
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(3))
        self.gate, self.o = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)
        self.norm = torch.nn.RMSNorm(32) if normed else torch.nn.Identity()  # the merged heads normalised first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, 4, 8).transpose(1, 2) for p in self.qkv)
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, 32)
        return self.o(torch.sigmoid(self.gate(x)) * self.norm(h))


class GateViewAs(torch.nn.Module):
    """A gate viewed as the attention heads it multiplies (`view_as`), per head before they are merged."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(3))
        self.gate, self.o = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, 4, 8).transpose(1, 2) for p in self.qkv)
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        return self.o((h * torch.sigmoid(self.gate(x)).view_as(h)).reshape(b, t, 32))


class RowsPerHead(torch.nn.Module):
    """Heads folded with the batch and the tokens into rows, (B * T * h, d), a per-row norm, then back to (B, T, h * d)
    (the chunked gated delta rule's layout)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.o = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        rows = self.q(x).view(b, t, 4, 8).reshape(b * t * 4, 8)
        return self.o(F.normalize(rows, dim=-1).reshape(b, t, 32))


class AlibiAttention(torch.nn.Module):
    """Scores of heads folded with the batch, (B * h, T, T), from baddbmm on a whole ALiBi bias (B * h, 1, T)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(3))
        self.o = torch.nn.Linear(32, 32)
        self.register_buffer("slopes", torch.tensor([0.5, 0.25, 0.125, 0.0625]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, 4, 8).transpose(1, 2).reshape(b * 4, t, 8) for p in self.qkv)
        pos = torch.arange(t, dtype=x.dtype, device=x.device)
        bias = (self.slopes.view(1, 4, 1, 1) * pos.view(1, 1, 1, t)).expand(b, 4, 1, t).reshape(b * 4, 1, t)
        weights = torch.baddbmm(bias, q, k.transpose(1, 2), alpha=8 ** -0.5).softmax(-1)
        return self.o(torch.bmm(weights, v).view(b, 4, t, 8).transpose(1, 2).reshape(b, t, 32))


class StackedGateMLP(torch.nn.Module):
    """A gated MLP whose one projection is viewed as (gate, up) stacked, (.., 2, 50), as Moshi's."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(32, 100), torch.nn.Linear(50, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x).view(*x.shape[:-1], 2, 50)
        return self.fc2(F.silu(h[..., 0, :]) * h[..., 1, :])


class ShortConv(torch.nn.Module):
    """A causal depthwise convolution over the 32 channels of a whole input (a short convolution), then a projection."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(32, 32, 3, groups=32, padding=2)
        self.down = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: the model's input, whole on every rank
        return self.down(self.conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2))


class PaddedTokens(torch.nn.Module):
    """A split width through ops without a row in the op table: F.pad along the tokens, a max over them."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(32, 100), torch.nn.Linear(100, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.pad(F.gelu(self.up(x)), (0, 0, 1, 0))  # a zero token in front
        return self.down(h + torch.max(h, dim=1, keepdim=True).values)


class ConvLinearAttention(torch.nn.Module):
    """q, k and v projections (4 heads of 8 each) concatenated, a short depthwise convolution over the 96 channels,
    split back and viewed as heads (linear attention's layout), then attention and an output projection."""

    def __init__(self, explicit_pad: bool = False) -> None:
        super().__init__()
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(32, 32, bias=False) for _ in range(3))
        self.conv = torch.nn.Conv1d(96, 96, 3, groups=96, padding=0 if explicit_pad else 2)
        self.o = torch.nn.Linear(32, 32)
        self.explicit_pad = explicit_pad  # causal by F.pad along the tokens, not the convolution's padding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = torch.cat([p(x) for p in self.qkv], dim=-1).transpose(1, 2)
        h = self.conv(F.pad(h, (2, 0))) if self.explicit_pad else self.conv(h)[..., :t]
        h = F.silu(h).transpose(1, 2)
        q, k, v = (part.view(b, t, 4, 8).transpose(1, 2) for part in h.split([32, 32, 32], dim=-1))
        return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, 32))


class GatedHeadNorm(torch.nn.Module):
    """Attention's 4 heads and a gate projection, both folded into rows of one head, (B*T*4, 8): the heads normalised
    per head times silu of the gate (a gated RMSNorm, as linear attention's output norm), merged back, projected."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(3))
        self.gate, self.o = torch.nn.Linear(32, 32, bias=False), torch.nn.Linear(32, 32)
        self.norm = torch.nn.RMSNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, 4, 8).transpose(1, 2) for p in self.qkv)
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(-1, 8)
        return self.o((self.norm(h) * F.silu(self.gate(x).reshape(-1, 8))).reshape(b, t, 32))


class InterleavedGLU(torch.nn.Module):
    """One projection to 50 (gate, up) pairs interleaved, read as `[..., ::2]` and `[..., 1::2]` (GPT-OSS's experts'
    layout), a gated unit and a projection back."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up, self.down = torch.nn.Linear(32, 100), torch.nn.Linear(50, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up(x)
        return self.down(F.silu(h[..., ::2]) * h[..., 1::2])


class SparseActivationMLP(torch.nn.Module):
    """An MLP of 100 features whose activations below mean + 1.2 std (over the features) are cut to zero, Gemma-3n's
    statistical top-k: a std and a mean over the split width, then the row split."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(32, 100), torch.nn.Linear(100, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        cutoff = h.mean(-1, keepdim=True) + h.std(-1, keepdim=True) * 1.2
        return self.down(F.relu(h - cutoff))


class GateTimesWhole(torch.nn.Module):
    """sigmoid of a projection to 20 features times a whole value of 20 (a slice of the input, RWKV's receptance
    times its value), an RMSNorm written out over the product and a projection back: at 3 ranks the padding of the
    product is zero because the whole factor is cut with zeros there (sigmoid's padding is 0.5)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.down = torch.nn.Linear(32, 20), torch.nn.Linear(20, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sigmoid(self.a(x)) * x[..., :20]
        return self.down(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))


class LogitStats(torch.nn.Module):
    """Logits over a vocabulary of 100 less their log-sum-exp (log-probabilities, as a z-loss reads them), and their
    max and min over the vocabulary: at 3 and 6 ranks the vocabulary is zero-padded, and a zero there would win a
    max over negative logits and add exp(0) to the sum."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(32, 100)
        with torch.no_grad():
            self.head.bias.sub_(5.0)  # every logit below zero: a padded zero would be the max

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.head(x)
        return z - torch.logsumexp(z, -1, keepdim=True) + z.amax(-1, keepdim=True) * (z + 10.0).amin(-1, keepdim=True)


class EmbeddingPlusProjection(torch.nn.Module):
    """Token embeddings of 20 features (a vocabulary split, its sum pending) plus a projection of them, an RMSNorm
    written out over the sum (a mean of squares) and a projection to 32: at 3 ranks the 20 features are padded, and
    the padding is zeros in both summands (the reduced embedding is cut with zeros there)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 20)
        self.a, self.down = torch.nn.Linear(20, 20), torch.nn.Linear(20, 32)
        self.scale = torch.nn.Parameter(torch.rand(20) + 0.5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.emb(ids)
        h = e + self.a(e)
        return self.down(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.scale)


class DiffAttention(torch.nn.Module):
    """Differential attention (DiffLlama's): the value heads chunked into two halves, each repeated for every query
    head; two attentions, their outputs joined by features, chunked into halves of the heads again and combined
    pairwise (head i minus lambda times head i + h/2), normalised per pair, then the output projection."""

    def __init__(self, heads: int = 4, width: int = 32) -> None:
        super().__init__()
        self.heads, self.head = heads, width // heads
        self.q, self.k, self.v, self.o = (torch.nn.Linear(width, width, bias=False) for _ in range(4))
        self.lam = torch.nn.Parameter(torch.tensor(0.3))
        self.norm = torch.nn.RMSNorm(2 * self.head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.heads, self.head).transpose(1, 2) for p in (self.q, self.k, self.v))
        v1, v2 = (half.repeat(1, 2, 1, 1) for half in torch.chunk(v, 2, dim=1))
        a = torch.cat([F.scaled_dot_product_attention(q, k, v1, is_causal=True),
                       F.scaled_dot_product_attention(q, k, v2, is_causal=True)], dim=-1).transpose(1, 2)
        first, second = torch.chunk(a, 2, dim=2)
        return x + self.o(self.norm(first - self.lam * second).reshape(b, t, -1))


class PairedHeads(torch.nn.Module):
    """Zamba's Mamba in_proj: its output features are (hidden, gate) pairs viewed as (B, F / 2, 2, T) and chunked
    into the two members; the hidden goes through a depthwise convolution and both are cut into 3 heads of 16,
    a softmax over each head's features: the unit of the projection is a pair times a head (32 rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.in_proj, self.out_proj = torch.nn.Linear(32, 96), torch.nn.Linear(48, 32)
        self.conv = torch.nn.Conv1d(48, 48, 3, groups=48, padding=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        hidden, gate = self.in_proj(x).transpose(1, 2).view(b, -1, 2, t).chunk(2, dim=2)
        hidden = F.silu(self.conv(hidden.squeeze(2))[..., :t]).reshape(b, 3, 16, t).softmax(dim=2)
        y = hidden * F.silu(gate.reshape(b, 3, 16, t))
        return self.out_proj(y.reshape(b, 48, t).transpose(1, 2))


class WholeInputConvHeads(torch.nn.Module):
    """A depthwise convolution fed the whole input (48 channels), its output cut into 3 heads of 16, a softmax over
    each head's features, then a projection: the convolution's channels split by whole heads."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(48, 48, 3, groups=48, padding=2)
        self.out_proj = torch.nn.Linear(48, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.conv(torch.cat([x, x[..., :16]], dim=-1).transpose(1, 2))[..., :t]
        return self.out_proj(h.reshape(b, 3, 16, t).softmax(dim=2).reshape(b, 48, t).transpose(1, 2))


class Recurrent(torch.nn.Module):
    """HRM's cycles: one attention + MLP block applied three times to a state plus the input, the first two under
    no_grad (the block's weights read detached there), the last with gradients."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (torch.nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.up, self.down = torch.nn.Linear(dim, 64), torch.nn.Linear(64, dim)
        self.register_buffer("init", 0.1 * torch.randn(dim))

    def block(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (p(F.rms_norm(x, (d,))).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(F.rms_norm(x, (d,)))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = self.init.expand_as(x)
        with torch.no_grad():
            for _ in range(2):
                state = self.block(state + x)
        return self.block(state + x)


class ExpertHeads(torch.nn.Module):
    """Experts picked by id out of one (experts, 32, 32) weight, their outputs cut into 2 heads of 16, a softmax over
    each head's features, then a projection. Summed over every expert, or (`grouped`) each token through one expert:
    the tokens grouped by expert, the outputs joined by token and put back in order by an index_add, then viewed as
    (B, T, 2, 16) (JetMoE's attention experts make their query heads so)."""

    def __init__(self, grouped: bool = False) -> None:
        super().__init__()
        self.grouped = grouped
        self.w = torch.nn.Parameter(torch.randn(4, 32, 32) / 32 ** 0.5)
        self.o = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        if self.grouped:
            flat = x.reshape(-1, 32)
            ids = flat[:, 0].gt(0).long() + 2 * flat[:, 1].gt(0).long()  # each token's expert
            order = ids.argsort(stable=True)
            parts = flat[order].split(F.one_hot(ids, 4).sum(0).tolist(), dim=0)
            out = torch.cat([F.linear(p, self.w[e]) for e, p in enumerate(parts)], dim=0)
            h = torch.zeros(b * t, 32, dtype=x.dtype).index_add(0, order, out).view(b, t, -1)
        else:
            h = sum(F.linear(x, self.w[e]) for e in range(4))
        return self.o(h.view(b, t, 2, 16).softmax(-1).reshape(b, t, 32))


class SlotHeads(torch.nn.Module):
    """JetMoE's attention: each token's query in k = 2 slots (its top-k experts), each slot 2 heads of 8, viewed as
    (B, T, k * 2, 8); the 2 key and value heads repeated k times to match (`repeat(1, k, 1, 1)`); the output viewed
    back as (B, T, k, 16) and projected per slot, the slots summed."""

    def __init__(self) -> None:
        super().__init__()
        self.slot = torch.nn.Parameter(1 + 0.1 * torch.randn(2, 32))
        self.q, self.kv, self.o = torch.nn.Linear(32, 16), torch.nn.Linear(32, 32), torch.nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x.unsqueeze(2) * self.slot).view(b, t, 4, 8).transpose(1, 2)
        k, v = (h.view(b, t, 2, 8).transpose(1, 2).repeat(1, 2, 1, 1) for h in self.kv(x).chunk(2, dim=-1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, 2, 16)
        return self.o(a).sum(2)
