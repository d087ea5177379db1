"""Random transformer-style models for property-based tests: a config strategy, the model, one case's run."""
from __future__ import annotations

import copy
import math
import traceback
import warnings
from dataclasses import asdict, dataclass, replace
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

import tpcompile
from tpcompile.api import shard_captured
from tpcompile.capture import Captured, capture

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
    capture = (draw(st.integers(2, 3)), draw(st.integers(2, 8)))
    run = (draw(st.integers(1, 3)), draw(st.integers(1, 8)))
    return FuzzConfig(
        vocab=vocab, width=width, depth=draw(st.integers(1, 2)), heads=heads, kv_heads=kv_heads,
        head_dim=head_dim, ffn_hidden=min(ffn_hidden, 128), fused_qkv=draw(st.booleans()),
        attention=draw(st.sampled_from(["sdpa", "manual"])), head_view=draw(st.sampled_from(["literal", "infer"])),
        ffn=draw(st.sampled_from(["mlp", "gated", "gated_fused"])), activation=draw(st.sampled_from(ACTIVATIONS)),
        bias=draw(st.booleans()), norm=draw(st.sampled_from(["layer", "rms"])),
        parallel_residual=draw(st.booleans()), tied=draw(st.booleans()), positions=draw(st.booleans()),
        capture_shape=capture, run_shape=run, seed=draw(st.integers(0, 2**16)))


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


def activate(x: torch.Tensor, name: str) -> torch.Tensor:
    """The activation function called `name`."""
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
        if cfg.attention == "manual":
            self.register_buffer("mask", torch.tril(torch.ones(BLOCK_SIZE, BLOCK_SIZE, dtype=torch.bool)))

    def heads(self, t: torch.Tensor, n: int) -> torch.Tensor:
        """(B, T, n*hd) -> (B, n, T, hd), the head count written as a literal or inferred."""
        B, T, _ = t.shape
        count = n if self.cfg.head_view == "literal" else -1
        return t.view(B, T, count, self.cfg.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        B, T, _ = x.shape
        if cfg.fused_qkv:
            q, k, v = self.qkv(x).split([self.q_dim, self.kv_dim, self.kv_dim], dim=-1)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        q, k, v = self.heads(q, cfg.heads), self.heads(k, cfg.kv_heads), self.heads(v, cfg.kv_heads)
        if cfg.kv_heads != cfg.heads:  # repeat each kv head for its group of query heads
            rep = cfg.heads // cfg.kv_heads
            k = k[:, :, None].expand(B, cfg.kv_heads, rep, T, cfg.head_dim).reshape(B, cfg.heads, T, cfg.head_dim)
            v = v[:, :, None].expand(B, cfg.kv_heads, rep, T, cfg.head_dim).reshape(B, cfg.heads, T, cfg.head_dim)
        if cfg.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(cfg.head_dim))  # (B, nh, T, T)
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
        return self.down(activate(self.up(x), act))


class Block(nn.Module):
    """Pre-norm block, sequential (x + attn, then + ffn) or parallel (x + attn + ffn)."""

    def __init__(self, cfg: FuzzConfig) -> None:
        super().__init__()
        self.parallel = cfg.parallel_residual
        self.norm1, self.attn = make_norm(cfg), Attention(cfg)
        self.norm2, self.ffn = make_norm(cfg), FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel:
            return x + self.attn(self.norm1(x)) + self.ffn(self.norm2(x))
        x = x + self.attn(self.norm1(x))
        return x + self.ffn(self.norm2(x))


class FuzzLM(nn.Module):
    """Token embedding, optional learned positions, blocks, final norm, LM head (tied or not)."""

    def __init__(self, cfg: FuzzConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.width)
        self.pos = nn.Embedding(BLOCK_SIZE, cfg.width) if cfg.positions else None
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.depth)])
        self.norm = make_norm(cfg)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)
        if cfg.tied:
            self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)  # (B, T, width)
        if self.pos is not None:
            x = x + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


@dataclass
class Outcome:
    """How one case ended: sharded (equal numerics), replicated parts (equal, with warnings), error, or a failure."""

    kind: str  # sharded | partly_replicated | error | mismatch | crash
    detail: str = ""

    @property
    def failed(self) -> bool:
        """True for the outcomes the product promises never to produce."""
        return self.kind in ("mismatch", "crash")


def build_model(cfg: FuzzConfig) -> FuzzLM:
    """The model for a config, initialised from its seed, in eval mode."""
    torch.manual_seed(cfg.seed)
    return FuzzLM(cfg).eval()


def run_case(cfg: FuzzConfig, world_sizes: Sequence[int], *, tol: float = 1e-4) -> dict[int, Outcome]:
    """Capture once; per world size shard, build every rank, simulate, compare with the original."""
    model = build_model(cfg)
    gen = torch.Generator().manual_seed(cfg.seed)
    example = torch.randint(0, cfg.vocab, cfg.capture_shape, generator=gen)
    x = torch.randint(0, cfg.vocab, cfg.run_shape, generator=gen)
    with torch.no_grad():
        ref = model(x)
    try:
        cap = capture(model, (example,))
    except tpcompile.TPCompileError as e:
        return {ws: Outcome("error", str(e).splitlines()[0]) for ws in world_sizes}
    out = {}
    for ws in world_sizes:
        with warnings.catch_warnings():  # copying the graph's pytree spec warns about a torch-internal alias
            warnings.simplefilter("ignore", FutureWarning)
            gm = copy.deepcopy(cap.gm)  # each world size its own copy: the passes annotate the graph in place
        out[ws] = _run_world(replace(cap, gm=gm), model, ws, x, ref, tol)
    return out


def _run_world(cap: Captured, model: nn.Module, ws: int, x: torch.Tensor, ref: torch.Tensor, tol: float) -> Outcome:
    """One (model, world size) case: TPCompileError, or every rank equal to `ref`."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", tpcompile.TPCompileWarning)
        try:
            sm = shard_captured(cap, ws)
            for r in range(ws):
                sm.rank(r)
        except tpcompile.TPCompileError as e:
            return Outcome("error", str(e).splitlines()[0])
        except Exception:  # noqa: BLE001  anything but TPCompileError before running is a defect
            return Outcome("crash", "shard: " + traceback.format_exc(limit=-3))
    replicated = any(issubclass(w.category, tpcompile.TPCompileWarning) for w in caught)
    try:
        with torch.no_grad():
            outs = tpcompile.simulate(sm, x)
    except Exception:  # noqa: BLE001  a sharded model that built cleanly must run
        return Outcome("crash", "simulate: " + traceback.format_exc(limit=-3))
    scale = max(1.0, float(ref.abs().max()))
    for r, out in enumerate(outs):
        if out.shape != ref.shape:
            return Outcome("mismatch", f"rank {r} output shape {tuple(out.shape)}, original {tuple(ref.shape)}")
        diff = float((out - ref).abs().max())
        if not diff <= tol * scale:  # also catches NaN
            return Outcome("mismatch", f"rank {r} max abs diff {diff:.3g} (limit {tol * scale:.3g})")
    return Outcome("partly_replicated" if replicated else "sharded")


def describe_failure(cfg: FuzzConfig, ws: int, outcome: Outcome) -> Optional[str]:
    """A report line for a failed case (None when it did not fail)."""
    return None if not outcome.failed else f"{outcome.kind} at world size {ws}: {outcome.detail}\n  case: {cfg!r}"
