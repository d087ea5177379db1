"""Grouped-query attention with parts computed per head beside q, k and v: a bias of the scores from a projection of
the tokens (a relative-position bias, Inkling's), and a projection of values per kv head that k or v is multiplied by
(Inkling 2's per-token convolution taps). 4 query heads of 8 over 2 kv heads, width 32."""
from __future__ import annotations

import torch
import torch.nn.functional as F

HEADS, KV, HEAD, REL, EXTENT = 4, 2, 8, 4, 6


class RelativeBiasAttention(torch.nn.Module):
    """Each query head's scores plus a bias by distance that its token chooses: `r` gives each token REL states per
    head, a bank of REL profiles over EXTENT distances turns them into a bias per distance, gathered by the distance
    of each key (0 past EXTENT); `eager`: attention written out (q @ k^T, the bias and a causal mask added, a
    softmax, @ v; "first": the scores added to the bias), else the bias as scaled_dot_product_attention's mask."""

    def __init__(self, eager: object = False) -> None:
        super().__init__()
        self.eager = eager
        self.q, self.o = torch.nn.Linear(32, HEADS * HEAD), torch.nn.Linear(HEADS * HEAD, 32)
        self.k, self.v = torch.nn.Linear(32, KV * HEAD), torch.nn.Linear(32, KV * HEAD)
        self.r = torch.nn.Linear(32, HEADS * REL, bias=False)
        self.bank = torch.nn.Parameter(torch.randn(REL, EXTENT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, HEADS, HEAD).transpose(1, 2)
        k, v = (p(x).view(b, t, KV, HEAD).transpose(1, 2)[:, :, None].expand(b, KV, HEADS // KV, t, HEAD)
                .reshape(b, HEADS, t, HEAD) for p in (self.k, self.v))
        logits = (self.r(x).view(b, t, HEADS, REL) @ self.bank).transpose(1, 2)  # (b, heads, t, EXTENT)
        pos = torch.arange(t, device=x.device)
        distance = (pos[:, None] - pos[None, :])[None, None]
        bias = logits.gather(-1, distance.clamp(0, EXTENT - 1).expand(b, HEADS, t, t))
        bias = bias.masked_fill((distance < 0) | (distance >= EXTENT), 0.0)
        causal = torch.full((t, t), float("-inf"), device=x.device).triu(1)
        if self.eager == "first":
            scores = (bias + causal) + torch.matmul(q, k.transpose(2, 3)) * HEAD ** -0.5
            h = torch.matmul(scores.softmax(-1), v)
        elif self.eager:
            scores = torch.matmul(q, k.transpose(2, 3)) * HEAD ** -0.5 + bias + causal
            h = torch.matmul(scores.softmax(-1), v)
        else:
            h = F.scaled_dot_product_attention(q, k, v, attn_mask=bias + causal)
        return self.o(h.transpose(1, 2).reshape(b, t, HEADS * HEAD))


class TappedKeyAttention(torch.nn.Module):
    """Keys and values each weighted by values per kv head and token that a projection of their own gives (`taps`:
    KV x 4 features, each head's features times its kv head's 4 taps, summed over them, as a per-token convolution's
    taps are; `summed`: KV x 3, summed into one factor): the projection is the key's or the value's companion, cut
    with its kv head."""

    def __init__(self, summed: bool = False) -> None:
        super().__init__()
        self.summed, taps = summed, 3 if summed else 4
        self.q, self.o = torch.nn.Linear(32, HEADS * HEAD), torch.nn.Linear(HEADS * HEAD, 32)
        self.k, self.v = torch.nn.Linear(32, KV * HEAD), torch.nn.Linear(32, KV * HEAD)
        self.k_taps, self.v_taps = torch.nn.Linear(32, KV * taps), torch.nn.Linear(32, KV * taps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, HEADS, HEAD).transpose(1, 2)
        kv = []
        for proj, taps in ((self.k, self.k_taps), (self.v, self.v_taps)):
            if self.summed:
                z = proj(x).view(b, t, KV, HEAD) * torch.sigmoid(taps(x)).view(b, t, KV, 3).sum(-1, keepdim=True)
            else:
                z = (proj(x).view(b, t, KV, HEAD, 1) * torch.sigmoid(taps(x)).view(b, t, KV, 1, 4)).sum(-1)
            z = z.transpose(1, 2)
            kv.append(z[:, :, None].expand(b, KV, HEADS // KV, t, HEAD).reshape(b, HEADS, t, HEAD))
        h = F.scaled_dot_product_attention(q, *kv, is_causal=True)
        return self.o(h.transpose(1, 2).reshape(b, t, HEADS * HEAD))
