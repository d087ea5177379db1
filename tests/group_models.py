"""Grouped-query attention and its neighbours whose kv heads, or key heads, are fewer than the ranks of
tests/test_more_ranks_than_heads.py: each kv group's query heads cut among the ranks sharing its kv head, or the
groups one to a rank, zero-padded; each one case of what meets them (a reduction, attention written out, a padding of
the tokens, a repeat_interleave, a gate).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class GroupSubNorm(torch.nn.Module):
    """Grouped-query attention, 4 query heads of 8 over 2 kv heads (repeated as transformers' repeat_kv does:
    expand, reshape), its merged heads reduced over before the output projection (`reduce`: an RMS written out,
    BitNet's sub-norm; a sum, a max, a vector norm, a variance): at 6 and 8 ranks each kv group's heads are cut among
    the ranks sharing its kv head, zeros past them."""

    def __init__(self, reduce: str = "mean") -> None:
        super().__init__()
        self.reduce = reduce
        self.q, self.k, self.v = torch.nn.Linear(32, 32), torch.nn.Linear(32, 16), torch.nn.Linear(32, 16)
        self.o = torch.nn.Linear(32, 32)
        self.scale = torch.nn.Parameter(torch.rand(32) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, 4, 8).transpose(1, 2)
        k, v = (p(x).view(b, t, 2, 8).transpose(1, 2)[:, :, None].expand(b, 2, 2, t, 8).reshape(b, 4, t, 8)
                for p in (self.k, self.v))
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, 32)
        stat = {"mean": lambda: torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6),
                "sum": lambda: 1 + h.sum(-1, keepdim=True) / 32, "amax": lambda: 1 + h.amax(-1, keepdim=True).abs(),
                "norm": lambda: 1 / h.norm(dim=-1, keepdim=True), "var": lambda: 1 + h.var(-1, keepdim=True)}
        return self.o(h * stat[self.reduce]() * self.scale)


class EagerGroupAttention(torch.nn.Module):
    """Grouped-query attention written out (Gemma-2's eager path): 4 query heads of 8 over 2 kv heads repeated as
    repeat_kv does, q @ k^T scaled and soft-capped (tanh), a causal mask added, a softmax, then @ v; `sinks`: the
    output scaled per head by a sigmoid of the scores' logsumexp less a parameter (attention sinks, GraniteMoe's:
    the scores read twice)."""

    def __init__(self, sinks: bool = False) -> None:
        super().__init__()
        self.q, self.k, self.v = torch.nn.Linear(32, 32), torch.nn.Linear(32, 16), torch.nn.Linear(32, 16)
        self.o = torch.nn.Linear(32, 32)
        self.sinks = torch.nn.Parameter(torch.randn(4)) if sinks else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, 4, 8).transpose(1, 2)
        k, v = (p(x).view(b, t, 2, 8).transpose(1, 2)[:, :, None].expand(b, 2, 2, t, 8).reshape(b, 4, t, 8)
                for p in (self.k, self.v))
        scores = torch.tanh(torch.matmul(q, k.transpose(2, 3)) * 8 ** -0.5 / 20) * 20
        mask = torch.full((t, t), float("-inf")).triu(1)
        a = torch.matmul((scores + mask).softmax(-1), v)
        if self.sinks is not None:
            a = a * torch.sigmoid((scores + mask).logsumexp(-1) - self.sinks[:, None])[..., None]
        return self.o(a.transpose(1, 2).reshape(b, t, 32))


class GroupPadTokens(torch.nn.Module):
    """Mamba-2's B: one group of 8 projected for every head (repeated for the 4 heads of 8, repeat_interleave),
    both padded along the tokens to a multiple of a chunk of 4 (F.pad), multiplied and summed over the tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.x, self.b, self.o = torch.nn.Linear(32, 32), torch.nn.Linear(32, 8), torch.nn.Linear(32, 32)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        b, t, _ = inp.shape
        x = self.x(inp).view(b, t, 4, 8)
        g = self.b(inp).view(b, t, 1, 8).repeat_interleave(4, dim=2)
        x, g = (F.pad(z, (0, 0, 0, 0, 0, -t % 4)) for z in (x, g))
        return self.o((x * g).cumsum(1)[:, :t].reshape(b, t, 32))


class GroupedKeyHeads(torch.nn.Module):
    """Qwen3-Next's linear attention projection: one projection laid out by key head, each of the 2 groups holding
    its query and key head (8 each) and its 2 value heads (16); the query and key heads repeated for the value heads
    (repeat_interleave), a gate per head from q . k, times the values."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = torch.nn.Linear(32, 64), torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 2, 32).split([8, 8, 16], dim=-1)
        q, k = (z.repeat_interleave(2, dim=2) for z in (q, k))
        gate = torch.sigmoid((q * k).sum(-1, keepdim=True))
        return self.o((gate * v.reshape(b, t, 4, 8)).reshape(b, t, 32))


class GatedGroupAttention(torch.nn.Module):
    """Grouped-query attention, 4 query heads of 8 over 2 kv heads, query and key normalised (`norms`: RMS over the
    whole projection, OLMoE's norms, which read no kv heads in pieces), its merged heads gated by a sigmoid of a
    projection of the input before the output projection (Dory's gate). `per_head`: the gate viewed as the heads
    before they are merged (`view_as`) plus a bias per head (Beam's)."""

    def __init__(self, norms: bool = True, per_head: bool = False) -> None:
        super().__init__()
        self.norms, self.per_head = norms, per_head
        self.q, self.k, self.v = torch.nn.Linear(32, 32), torch.nn.Linear(32, 16), torch.nn.Linear(32, 16)
        self.gate, self.o = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)
        self.gate_bias = torch.nn.Parameter(torch.randn(4)) if per_head else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k = (F.rms_norm(p(x), (n,)) if self.norms else p(x) for p, n in ((self.q, 32), (self.k, 16)))
        q, k = q.view(b, t, 4, 8).transpose(1, 2), k.view(b, t, 2, 8).transpose(1, 2)
        v = self.v(x).view(b, t, 2, 8).transpose(1, 2)
        k, v = (z[:, :, None].expand(b, 2, 2, t, 8).reshape(b, 4, t, 8) for z in (k, v))
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        if self.per_head:
            gate = self.gate(x).view_as(h) + self.gate_bias[None, None, :, None]
            return self.o((h * torch.sigmoid(gate)).reshape(b, t, 32))
        return self.o(h.reshape(b, t, 32) * torch.sigmoid(self.gate(x)))


class KeyRepeatLinearAttention(torch.nn.Module):
    """A linear attention read as Qwen3.5's gated delta rule reads its heads: 2 query and 2 key heads (8 each) and 4
    value heads (8 each), the query and key heads repeated for the value heads (repeat_interleave); per value head a
    step size (a sigmoid of a projection) and a decay (a parameter times a softplus of a projection); causal scores
    decayed between tokens; the first token's values written into a temporary in place; normalised per head with the
    heads folded into the rows and gated by a projection before the output projection. `layout`: q | k | v from one
    projection through a short depthwise convolution (Qwen3.5), from three joined for it (cat, OLMo-Hybrid), or from
    three apart."""

    def __init__(self, layout: str = "fused") -> None:
        super().__init__()
        self.layout = layout
        if layout == "fused":
            self.qkv = torch.nn.Linear(32, 64, bias=False)
        else:
            self.q, self.k, self.v = (torch.nn.Linear(32, n, bias=False) for n in (16, 16, 32))
        if layout != "apart":
            self.conv = torch.nn.Conv1d(64, 64, 3, groups=64, padding=2, bias=False)
        self.beta, self.decay = torch.nn.Linear(32, 4), torch.nn.Linear(32, 4)
        self.a_log = torch.nn.Parameter(torch.rand(4) - 0.5)
        self.z, self.o = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)
        self.norm = torch.nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        if self.layout == "apart":
            q, k, v = self.q(x), self.k(x), self.v(x)
        else:
            qkv = self.qkv(x) if self.layout == "fused" else torch.cat([self.q(x), self.k(x), self.v(x)], -1)
            q, k, v = F.silu(self.conv(qkv.transpose(1, 2))[..., :t]).transpose(1, 2).split([16, 16, 32], -1)
        q, k = (F.normalize(z.view(b, t, 2, 8), dim=-1).repeat_interleave(2, dim=2).transpose(1, 2) for z in (q, k))
        v = v.view(b, t, 4, 8).transpose(1, 2)
        step = torch.sigmoid(self.beta(x)).transpose(1, 2)[..., None]
        g = (-self.a_log.exp() * F.softplus(self.decay(x))).transpose(1, 2).cumsum(-1)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        scores = (q @ k.transpose(-1, -2)) * (g[..., :, None] - g[..., None, :]).masked_fill(~mask, -1e9).exp()
        y = scores @ (v * step)
        first = torch.zeros_like(y)
        first[:, :, :1] = v[:, :, :1]
        y = (y + first).transpose(1, 2).reshape(-1, 8)
        y = F.rms_norm(y, (8,)) * self.norm * F.silu(self.z(x).reshape(-1, 8))
        return self.o(y.reshape(b, t, 32))


class SharedRopeKeys(torch.nn.Module):
    """Multi-head latent attention's keys (DeepSeek-V3's): 4 heads, each key the head's own 8 features, projected
    up from a normalised latent of 8 with its value, and 4 rotary features shared by every head (projected with the
    latent, expanded over the heads), written into a fresh tensor (new_empty) slice by slice."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.kv_a, self.kv_b = torch.nn.Linear(32, 48), torch.nn.Linear(32, 12), torch.nn.Linear(8, 64)
        self.o = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, 4, 12).transpose(1, 2)
        latent, rope = self.kv_a(x).split([8, 4], -1)
        own, v = self.kv_b(F.rms_norm(latent, (8,))).view(b, t, 4, 16).transpose(1, 2).split([8, 8], -1)
        k = own.new_empty(b, 4, t, 12)
        k[:, :, :, :8] = own
        k[:, :, :, 8:] = rope.view(b, 1, t, 4).expand(-1, 4, -1, -1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(a.transpose(1, 2).reshape(b, t, 32))


class OneGroupHeads(torch.nn.Module):
    """Mamba-2's heads read with one group of B and C: one projection of x (4 heads of 8) | B | C (one group of 8
    each, whole on every rank, repeated for the heads), a decay per head (from a projection of 4); scores B . C per
    head times the decay, causal, times x; a norm over the merged heads (one norm group), gated; the output
    projection."""

    def __init__(self) -> None:
        super().__init__()
        self.xbc, self.dt = torch.nn.Linear(32, 48), torch.nn.Linear(32, 4)
        self.z, self.o = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)
        self.a_log = torch.nn.Parameter(torch.rand(4) - 0.5)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        b, t, _ = inp.shape
        x, B, C = self.xbc(inp).split([32, 8, 8], -1)
        B, C = (v.view(b, t, 1, 8).repeat_interleave(4, dim=2) for v in (B, C))
        decay = (-self.a_log.exp() * F.softplus(self.dt(inp))).cumsum(1)  # (b, t, heads)
        mask = torch.ones(t, t, dtype=torch.bool).tril()[None, :, :, None]
        gaps = (decay[:, :, None] - decay[:, None]).masked_fill(~mask, -1e9).exp()
        y = torch.einsum("blsh,bshp->blhp", torch.einsum("blhn,bshn->blsh", C, B) * gaps, x.view(b, t, 4, 8))
        y = y.reshape(b, t, 32)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6) * F.silu(self.z(inp))
        return self.o(y)


class RepeatedMultiQuery(torch.nn.Module):
    """GPTBigCode's multi-query attention: 4 query heads of 8 and one key and one value head from one fused
    projection (unsqueezed, then split into q | k | v along the features), the key and value head repeated over the
    query heads (`repeat_kv`: expand and reshape) before attention."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = torch.nn.Linear(32, 48), torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).unsqueeze(1).split((32, 8, 8), dim=3)
        q = q.view(b, t, 4, 8).transpose(1, 2)
        k, v = (z[:, :, None].expand(b, 1, 4, t, 8).reshape(b, 4, t, 8) for z in (k, v))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()[None, None].expand(b, 1, t, t)
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o(h.transpose(1, 2).reshape(b, t, 32))
