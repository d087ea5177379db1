"""Random transformer-style models for property-based tests: a config strategy, the model, one case's run."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from moe_models import LAYOUTS, MoE, MoEConfig
from torch import nn


ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu", "tanh")
BLOCK_SIZE = 16  # longest sequence the manual attention mask and learned positions cover


@dataclass(frozen=True)
class FuzzConfig:
    """One generated model and how it is sharded and run."""

    vocab: int
    width: int
    depth: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn_hidden: int
    fused_qkv: bool
    attention: str  # sdpa | manual
    head_view: str  # literal: view(B, T, heads, hd) | infer: view(B, T, -1, hd)
    ffn: str  # mlp | gated | gated_fused
    activation: str
    bias: bool
    norm: str  # layer | rms
    parallel_residual: bool
    tied: bool
    positions: bool  # learned position embeddings
    capture_shape: tuple[int, int]
    run_shape: tuple[int, int]
    seed: int
    head_form: str = "linear"  # linear | matmul_t (h @ W.t()) | einsum ('btd,vd->btv')
    weight_read: str = "none"  # none | norm | row | mean: a weight read outside its Linear
    inplace: bool = False  # in-place activations and residual adds (relu_, add_)
    max_norm: bool = False  # nn.Embedding(max_norm=...): rows renormalised in place
    literals: bool = False  # tensor literals in forward
    kwargs_forward: bool = False  # forward(idx, **kwargs) called with a bias=...
    autocast: bool = False  # captured and run under torch.autocast('cpu', bfloat16)
    rotary: str = "none"  # none | half (rotate_half) | interleaved (stack + flatten) | complex (view_as_complex)
    alibi: bool = False  # per-head linear bias added to the scores (manual attention), sliced by head
    kv_repeat: str = "expand"  # expand | repeat_interleave | enable_gqa (sdpa reads them itself): how kv heads
    # are repeated for their query groups
    qkv_form: str = "split"  # split | slice (qkv[..., :q]) | per_head (view(B, T, H, 3, D)); fused only
    embed_proj: int = 0  # the embedding's width E when it is projected up to the model width (0: none)
    moe: str = "none"  # none | a tests/moe_models.py layout: the feed-forward is a mixture of experts
    comm: str = "off"  # the comm passes: off (comm=False) | default (comm=None) | async (asynchronous=True)

    def short(self) -> str:
        """The config as one line of key=value, for failure reports."""
        return " ".join(f"{k}={v}" for k, v in asdict(self).items())


@st.composite
def fuzz_configs(draw: st.DrawFn) -> FuzzConfig:
    """A random tiny transformer: width <= 64, depth <= 2, sequences <= 8 tokens."""
    head_dim = draw(st.sampled_from([2, 4, 8]))
    heads = draw(st.integers(1, min(8, 64 // head_dim)))
    kv_heads = draw(st.sampled_from([d for d in range(1, heads + 1) if heads % d == 0]))
    width = draw(st.one_of(st.just(heads * head_dim), st.sampled_from([8, 12, 16, 24, 32, 48, 64])))
    vocab = draw(st.one_of(st.sampled_from([16, 32, 48, 64]), st.integers(9, 67)))
    ffn_hidden = draw(st.one_of(st.just(4 * width), st.sampled_from([8, 12, 20, 24, 32, 36, 48, 64])))
    kind = draw(st.sampled_from(["usual"] * 6 + ["size-1", "equal"]))
    if kind == "usual":
        capture = (draw(st.integers(2, 3)), draw(st.integers(2, 8)))
    elif kind == "size-1":  # a dim of 1 is fixed by the capture: mostly run at 1, else the guard must say so
        capture = draw(st.sampled_from([(1, draw(st.integers(2, 8))), (draw(st.integers(2, 3)), 1), (1, 1)]))
    else:
        capture = (draw(st.integers(2, 4)),) * 2
    run = (draw(st.integers(1, 3)), draw(st.integers(1, 8)))
    if kind == "size-1" and draw(st.integers(0, 2)):
        run = tuple(1 if c == 1 else r for c, r in zip(capture, run))
    fields = dict(  # drawn in this order (keyword arguments are evaluated left to right)
        vocab=vocab, width=width, depth=draw(st.integers(1, 2)), heads=heads, kv_heads=kv_heads,
        head_dim=head_dim, ffn_hidden=min(ffn_hidden, 128), fused_qkv=draw(st.booleans()),
        attention=draw(st.sampled_from(["sdpa", "manual"])), head_view=draw(st.sampled_from(["literal", "infer"])),
        ffn=draw(st.sampled_from(["mlp", "gated", "gated_fused"])), activation=draw(st.sampled_from(ACTIVATIONS)),
        bias=draw(st.booleans()), norm=draw(st.sampled_from(["layer", "rms"])),
        parallel_residual=draw(st.booleans()), tied=draw(st.booleans()), positions=draw(st.booleans()),
        capture_shape=capture, run_shape=run, seed=draw(st.integers(0, 2**16)),
        head_form=draw(st.sampled_from(["linear"] * 4 + ["matmul_t", "einsum"])),
        weight_read=draw(st.sampled_from(["none"] * 9 + ["norm", "row", "mean"])), inplace=_rarely(draw, 4),
        max_norm=_rarely(draw, 8), literals=_rarely(draw, 4), kwargs_forward=_rarely(draw, 4),
        autocast=_rarely(draw, 6))
    idioms = draw(_idioms(heads, kv_heads, width, fields["autocast"]))
    return FuzzConfig(**fields, **idioms, comm=draw(st.sampled_from(["off", "off", "default", "async"])))


@st.composite
def _idioms(draw: st.DrawFn, heads: int, kv_heads: int, width: int, autocast: bool) -> dict:
    """Position, attention, embedding and expert idioms of real models, each now and then (no experts under
    autocast: the example MoE mixes its router's float32 weights with bfloat16 activations)."""
    fused_per_head = kv_heads == heads and _rarely(draw, 4)
    return dict(
        rotary=draw(st.sampled_from(["none"] * 5 + ["half", "interleaved", "complex"])), alibi=_rarely(draw, 5),
        kv_repeat=draw(st.sampled_from(["expand", "expand", "repeat_interleave", "enable_gqa"])),
        qkv_form="per_head" if fused_per_head else draw(st.sampled_from(["split", "split", "slice"])),
        embed_proj=draw(st.sampled_from([0] * 6 + [8, 12, 16])) if width > 8 else 0,
        moe="none" if autocast else draw(st.sampled_from(["none"] * 7 + list(LAYOUTS[:2]) + ["bmm", "einsum"])))


def _rarely(draw: st.DrawFn, one_in: int) -> bool:
    """True about once in `one_in` draws: each idiom stays rare, so plain models stay common."""
    return draw(st.integers(1, one_in)) == 1


class RMSNorm(nn.Module):
    """Root-mean-square norm written out in ops (no fused kernel)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def make_norm(cfg: FuzzConfig) -> nn.Module:
    """LayerNorm (with or without bias) or RMSNorm over the width."""
    return nn.LayerNorm(cfg.width, bias=cfg.bias) if cfg.norm == "layer" else RMSNorm(cfg.width)


def activate(x: torch.Tensor, name: str, inplace: bool = False) -> torch.Tensor:
    """The activation function called `name` (in place on x when asked and torch has one)."""
    if inplace and name in ("relu", "silu", "tanh"):
        return {"relu": torch.relu_, "silu": lambda t: F.silu(t, inplace=True), "tanh": torch.tanh_}[name](x)
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    return {"gelu": F.gelu, "relu": F.relu, "silu": F.silu, "tanh": torch.tanh}[name](x)


class Attention(nn.Module):
    """Causal attention with grouped kv heads, fused or separate projections, SDPA or written out."""

    def __init__(self, cfg: FuzzConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.q_dim, self.kv_dim = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        if cfg.fused_qkv:
            self.qkv = nn.Linear(cfg.width, self.q_dim + 2 * self.kv_dim, bias=cfg.bias)
        else:
            self.q = nn.Linear(cfg.width, self.q_dim, bias=cfg.bias)
            self.k = nn.Linear(cfg.width, self.kv_dim, bias=cfg.bias)
            self.v = nn.Linear(cfg.width, self.kv_dim, bias=cfg.bias)
        self.o = nn.Linear(self.q_dim, cfg.width, bias=cfg.bias)
        if cfg.attention == "manual" or cfg.alibi:
            self.register_buffer("mask", torch.tril(torch.ones(BLOCK_SIZE, BLOCK_SIZE, dtype=torch.bool)))
        if cfg.alibi:  # slope per head times the distance to the key, (heads, T, T)
            slopes = 2.0 ** (-8.0 * torch.arange(1, cfg.heads + 1) / cfg.heads)
            dist = torch.arange(BLOCK_SIZE)[None, :] - torch.arange(BLOCK_SIZE)[:, None]
            self.register_buffer("alibi", slopes[:, None, None] * dist[None].float())
        if cfg.rotary != "none":
            freq = 1.0 / (10000 ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
            angle = torch.outer(torch.arange(BLOCK_SIZE).float(), freq)  # (BLOCK_SIZE, head_dim / 2)
            self.register_buffer("cos", angle.cos())
            self.register_buffer("sin", angle.sin())

    def heads(self, t: torch.Tensor, n: int) -> torch.Tensor:
        """(B, T, n*hd) -> (B, n, T, hd), the head count written as a literal or inferred."""
        B, T, _ = t.shape
        count = n if self.cfg.head_view == "literal" else -1
        return t.view(B, T, count, self.cfg.head_dim).transpose(1, 2)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as (B, heads, T, hd): separate projections, or one fused projection cut three ways."""
        cfg = self.cfg
        B, T, _ = x.shape
        if not cfg.fused_qkv:
            q, k, v = self.q(x), self.k(x), self.v(x)
            return self.heads(q, cfg.heads), self.heads(k, cfg.kv_heads), self.heads(v, cfg.kv_heads)
        qkv = self.qkv(x)
        if cfg.qkv_form == "per_head":  # (B, T, H, 3, D): each head's q, k, v side by side
            q, k, v = qkv.view(B, T, cfg.heads, 3, cfg.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
            return q, k, v
        if cfg.qkv_form == "slice":
            qk = self.q_dim + self.kv_dim
            q, k, v = qkv[..., :self.q_dim], qkv[..., self.q_dim:qk], qkv[..., qk:]
        else:
            q, k, v = qkv.split([self.q_dim, self.kv_dim, self.kv_dim], dim=-1)
        return self.heads(q, cfg.heads), self.heads(k, cfg.kv_heads), self.heads(v, cfg.kv_heads)

    def rotate(self, t: torch.Tensor) -> torch.Tensor:
        """Rotary position embedding of (B, h, T, hd) in the configured form."""
        T = t.shape[2]
        cos, sin = self.cos[:T], self.sin[:T]
        if self.cfg.rotary == "half":
            x1, x2 = t.chunk(2, dim=-1)
            return t * torch.cat([cos, cos], -1) + torch.cat([-x2, x1], -1) * torch.cat([sin, sin], -1)
        if self.cfg.rotary == "interleaved":
            x1, x2 = t[..., 0::2], t[..., 1::2]
            return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)
        z = torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2))
        return torch.view_as_real(z * torch.polar(torch.ones_like(cos), torch.atan2(sin, cos))).flatten(-2).type_as(t)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        B, T, _ = x.shape
        q, k, v = self.project(x)
        if cfg.rotary != "none":
            q, k = self.rotate(q), self.rotate(k)
        by_sdpa = cfg.kv_repeat == "enable_gqa" and cfg.attention == "sdpa" and not cfg.alibi
        if cfg.kv_heads != cfg.heads and not by_sdpa:  # repeat each kv head for its group of query heads
            rep = cfg.heads // cfg.kv_heads
            if cfg.kv_repeat == "repeat_interleave":
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            else:
                shape = (B, cfg.heads, T, cfg.head_dim)
                k = k[:, :, None].expand(B, cfg.kv_heads, rep, T, cfg.head_dim).reshape(shape)
                v = v[:, :, None].expand(B, cfg.kv_heads, rep, T, cfg.head_dim).reshape(shape)
        if cfg.attention == "sdpa" and not cfg.alibi:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=by_sdpa)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(cfg.head_dim))  # (B, nh, T, T)
            if cfg.alibi:
                att = att + self.alibi[:, :T, :T]
            att = att.masked_fill(~self.mask[:T, :T], float("-inf")).softmax(dim=-1)
            y = att @ v
        return self.o(y.transpose(1, 2).reshape(B, T, self.q_dim))


class FeedForward(nn.Module):
    """Up, activation, down; gated variants multiply by a second (possibly fused) projection."""

    def __init__(self, cfg: FuzzConfig) -> None:
        super().__init__()
        self.cfg = cfg
        if cfg.ffn == "gated_fused":
            self.gate_up = nn.Linear(cfg.width, 2 * cfg.ffn_hidden, bias=cfg.bias)
        else:
            self.up = nn.Linear(cfg.width, cfg.ffn_hidden, bias=cfg.bias)
            if cfg.ffn == "gated":
                self.gate = nn.Linear(cfg.width, cfg.ffn_hidden, bias=cfg.bias)
        self.down = nn.Linear(cfg.ffn_hidden, cfg.width, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = self.cfg.activation
        if self.cfg.ffn == "gated_fused":
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            return self.down(activate(gate, act) * up)
        if self.cfg.ffn == "gated":
            return self.down(activate(self.gate(x), act) * self.up(x))
        return self.down(activate(self.up(x), act, self.cfg.inplace))


class FuzzMoE(nn.Module):
    """A mixture of experts (tests/moe_models.py) on (B, T, width): 4 experts of ffn_hidden / 2, top 2."""

    def __init__(self, cfg: FuzzConfig) -> None:
        super().__init__()
        self.moe = MoE(MoEConfig(width=cfg.width, experts=4, top_k=2, inner=max(2, cfg.ffn_hidden // 2),
                                 layout=cfg.moe))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)


class Block(nn.Module):
    """Pre-norm block, sequential (x + attn, then + ffn) or parallel (x + attn + ffn)."""

    def __init__(self, cfg: FuzzConfig) -> None:
        super().__init__()
        self.parallel, self.inplace = cfg.parallel_residual, cfg.inplace
        self.norm1, self.attn = make_norm(cfg), Attention(cfg)
        self.norm2 = make_norm(cfg)
        self.ffn = FeedForward(cfg) if cfg.moe == "none" else FuzzMoE(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel:
            return x + self.attn(self.norm1(x)) + self.ffn(self.norm2(x))
        x = x + self.attn(self.norm1(x))
        if self.inplace:  # the branch's fresh output takes the residual in place
            return self.ffn(self.norm2(x)).add_(x)
        return x + self.ffn(self.norm2(x))


class FuzzLM(nn.Module):
    """Token embedding, optional learned positions, blocks, final norm, LM head (tied or not)."""

    def __init__(self, cfg: FuzzConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.embed_proj or cfg.width, max_norm=1.0 if cfg.max_norm else None)
        self.embed_up = nn.Linear(cfg.embed_proj, cfg.width, bias=cfg.bias) if cfg.embed_proj else None
        self.pos = nn.Embedding(BLOCK_SIZE, cfg.width) if cfg.positions else None
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.depth)])
        self.norm = make_norm(cfg)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)
        if cfg.tied and not cfg.embed_proj:
            self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        x = self.embed(idx) if self.embed_up is None else self.embed_up(self.embed(idx))  # (B, T, width)
        if "bias" in kwargs:
            x = x + kwargs["bias"]
        if self.pos is not None:
            x = x + self.pos(torch.arange(idx.shape[1], device=idx.device))
        if cfg.literals:
            x = x * torch.tensor(0.75) + torch.linspace(-0.1, 0.1, cfg.width)
        for block in self.blocks:
            x = block(x)
        x = x + self.read_weight()
        h = self.norm(x)
        w = self.embed.weight if cfg.tied and not cfg.embed_proj else self.head.weight
        if cfg.head_form == "matmul_t":
            return h @ w.t()
        if cfg.head_form == "einsum":
            return torch.einsum("btd,vd->btv", h, w)
        return self.head(h)

    def read_weight(self) -> torch.Tensor:
        """A (width,) vector read off a weight outside its Linear: a norm, a row, a mean (or 0)."""
        ffn = self.blocks[0].ffn
        if self.cfg.moe != "none" or self.cfg.weight_read == "none":
            return torch.zeros(self.cfg.width)
        w = ffn.gate_up.weight if self.cfg.ffn == "gated_fused" else ffn.up.weight  # (hidden, width)
        if self.cfg.weight_read == "norm":
            return w.pow(2).sum() * 1e-3 * torch.ones(self.cfg.width)
        if self.cfg.weight_read == "row":
            return 0.1 * w[0] + 0.1 * ffn.down.weight[:, 0]
        if self.cfg.weight_read == "mean":
            return w.mean(0)
        return torch.zeros(self.cfg.width)


def build_model(cfg: FuzzConfig) -> FuzzLM:
    """The model for a config, initialised from its seed, in eval mode."""
    torch.manual_seed(cfg.seed)
    return FuzzLM(cfg).eval()
