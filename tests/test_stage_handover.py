"""Any value crosses a pipeline-stage boundary: views, expanded and permuted tensors, integer and boolean
tensors, values passed in nested tuples, values used two or more stages later.

The model is T5-like: its first block makes a (B, H, T, T) position bias by permute and expand, which every
later block reuses; a boolean mask, integer positions and a float mask without gradient go to every block
in nested tuples, and the positions also to the head.
"""
from __future__ import annotations

import functools
import math
import operator
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining._backward import stage_backward

import tpcompile
from tpcompile.api import shard_captured
from tpcompile.capture import Captured, capture
from tpcompile.hybrid.io import graph_io
from tpcompile.hybrid.partition import group_pieces, stage_io
from tpcompile.hybrid.pieces import find_blocks, split_pieces
from tpcompile.hybrid.pipeline import _meta
from tpcompile.hybrid.stage import build_stage

VOCAB, BATCH, SEQ, REL = 32, 4, 6, 4


class Block(nn.Module):
    """Pre-norm attention and MLP; the first block makes the position bias that the later ones reuse."""

    def __init__(self, c: int, heads: int, first: bool) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.qkv, self.proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.fc, self.out = nn.Linear(c, 2 * c), nn.Linear(2 * c, c)
        self.rel = nn.Embedding(2 * REL + 1, heads) if first else None

    def forward(self, x: torch.Tensor, bias: Optional[torch.Tensor], aux: tuple) -> tuple:
        keep, (pos, fmask) = aux
        b, t, c = x.shape
        if bias is None:  # T5: relative-position buckets from the sizes, one bias per head
            ar = torch.arange(t, device=x.device)
            rel = (ar[None, :] - ar[:, None]).clamp(-REL, REL) + REL  # (T, T) int
            bias = self.rel(rel).permute(2, 0, 1).unsqueeze(0).expand(b, -1, -1, -1)  # (B, H, T, T), a view
        q, k, v = (y.view(b, t, self.heads, -1).transpose(1, 2) for y in self.qkv(self.ln1(x)).split(c, -1))
        att = q @ k.transpose(-1, -2) / math.sqrt(c // self.heads) + bias + fmask[:, None, None, :]
        att = att.masked_fill(~keep[:, None, None, :], -1e9).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, c))
        x = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return x, (bias, (keep, (pos, fmask)))


class T5Like(nn.Module):
    """Token embedding, two blocks sharing the first one's position bias, a head that also reads positions."""

    def __init__(self, c: int = 16, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, c)
        self.blocks = nn.ModuleList(Block(c, heads, i == 0) for i in range(layers))
        self.ln, self.head = nn.LayerNorm(c), nn.Linear(c, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        keep = ids != 0  # bool
        pos = keep.long().cumsum(-1) - 1  # int64
        x = self.emb(ids)
        fmask = (ids == 1).to(x.dtype) * -1e4  # float, computed from the ids alone: no gradient
        bias, aux = None, (keep, (pos, fmask))
        for block in self.blocks:
            x, (bias, aux) = block(x, bias, aux)
        keep, (pos, _) = aux
        return self.head(self.ln(x)) * keep[..., None] + 0.01 * pos[..., None]


def build() -> T5Like:
    """The model in float64, the same on every call."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return T5Like().to(torch.float64)


def batches(steps: int) -> list[torch.Tensor]:
    """`steps` random (BATCH, SEQ) batches of token ids, zeros (masked) and ones (float-masked) among them."""
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB // 4, (BATCH, SEQ), generator=gen) for _ in range(steps)]


def loss_fn(out: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Cross entropy of every position's logits against its own token."""
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), ids.reshape(-1))


@functools.cache
def _stages(n: int) -> tuple[nn.Module, list[Any], list[tuple[list, list]]]:
    """The model cut into `n` stages (pieces sharded over one rank), and every stage's captured inputs/outputs."""
    model = build()
    cap = capture(model, (batches(1)[0],), {})
    pieces = split_pieces(cap.gm, find_blocks(model))
    groups = group_pieces(pieces, n)
    io = stage_io(groups, *graph_io(cap.gm))
    built = []
    for s, group in enumerate(groups):
        ranked = [shard_captured(Captured(p.gm, p.name, (), {}, cap.module_paths), 1).rank(0) for p in group]
        built.append(build_stage(s, group, ranked, *io[s]))
    return model, built, io


def _received(values: tuple) -> list[torch.Tensor]:
    """What a next stage gets: fresh leaves, floats carrying gradients (as pipelining's receive buffers)."""
    return [v.detach().clone().requires_grad_(v.is_floating_point()) for v in values]


def test_every_kind_of_value_leaves_a_stage_contiguous() -> None:
    """4 stages: bias view, bool, int and float-mask outputs are dense tensors of their dtypes; positions are
    passed on through two stages unchanged; the composed stages give the model's output (1e-12)."""
    model, stages, io = _stages(4)
    ids = batches(1)[0]
    kinds: set[torch.dtype] = set()
    values: tuple = (ids,)
    sent: list[dict[str, torch.Tensor]] = []
    for s, stage in enumerate(stages):
        out = tpcompile.simulate_ranks(1, lambda r: stage(*values))[0]
        values = out if isinstance(out, tuple) else (out,)
        sent.append({n.name: v for n, v in zip(io[s][1], values)})
        if s < len(stages) - 1:
            assert all(v.is_contiguous() for v in values), [n.name for n, v in zip(io[s][1], values)]
            kinds |= {v.dtype for v in values}
    assert {torch.bool, torch.int64, torch.float64} <= kinds
    assert any(v.dim() == 4 for v in sent[1].values())  # the first block's (B, H, T, T) position bias crosses
    pos = next(name for name, v in sent[0].items() if v.dtype == torch.int64)
    assert pos in sent[1] and pos in sent[2] and torch.equal(sent[2][pos], sent[0][pos])  # passed on
    torch.testing.assert_close(values[0], model(ids), rtol=0, atol=1e-12)


def test_backward_runs_through_stages_with_bool_and_int_outputs() -> None:
    """Each stage's backward as pipelining runs it (stage_backward; no gradient for bool/int outputs): every
    parameter's gradient equals the model's."""
    model, stages, _ = _stages(4)
    ids = batches(1)[0]

    def run(rank: int) -> list:
        """Forward stage by stage on received copies, then backward from the last stage to the first."""
        inputs, outputs = [], []
        values: list[torch.Tensor] = [ids]
        for stage in stages:
            out = stage(*values)
            out = list(out) if isinstance(out, tuple) else [out]
            inputs.append(values)
            outputs.append(out)
            values = _received(tuple(out))
        loss = loss_fn(outputs[-1][0], ids)
        grads: Optional[list] = None
        for s in range(len(stages) - 1, -1, -1):
            outs, gs = ([loss], [None]) if grads is None else (outputs[s], grads)
            grads = list(stage_backward(outs, gs, inputs[s]))
        return outputs[0]

    for m in (model, *stages):
        m.zero_grad()
    first = tpcompile.simulate_ranks(1, run)[0]
    assert {torch.bool, torch.int64} <= {v.dtype for v in first}
    loss_fn(model(ids), ids).backward()
    want = dict(model.named_parameters())
    got = {n: p for stage in stages for n, p in stage.named_parameters()}
    assert got.keys() == want.keys()
    for name, p in got.items():
        torch.testing.assert_close(p.grad, want[name].grad, rtol=0, atol=1e-12, msg=name)


def test_a_multi_output_op_and_its_elements_stay_in_one_piece() -> None:
    """A chunk's elements recorded under another module stay with the chunk: no tuple value crosses a piece."""

    class Split(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 16)

        def forward(self, x: torch.Tensor) -> tuple:
            return self.lin(x).chunk(2, -1)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Split() for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                a, b = block(x)
                x = a * b
            return x

    model = Model()
    cap = capture(model, (torch.randn(2, 3, 8),), {})
    for n in cap.gm.graph.nodes:  # as if tracing had recorded the elements where they are used
        if n.target is operator.getitem:
            n.meta["nn_module_stack"] = {}
    pieces = split_pieces(cap.gm, find_blocks(model))
    crossing = [i for p in pieces for i in p.inputs]
    assert crossing and all(isinstance(i.meta["val"], torch.Tensor) for i in crossing)


def test_a_non_tensor_between_stages_is_refused_by_name() -> None:
    """A size or other non-tensor value between stages is a TPCompileError naming it, not an attribute error."""
    with pytest.raises(tpcompile.TPCompileError, match="item_1 passes from one pipeline stage to another"):
        _meta(("item_1", 3), {})


LAYOUT = (1, 1, 2)  # (dp, tp, pp)
# 4 stages on 2 ranks (0 and 2 on one, 1 and 3 on the other): the embedding, each block, the head, so the
# position bias crosses from stage 1 to 2 and the positions are passed on from stage 0 through 1 and 2 to 3
SCHEDULE = "Interleaved1F1B"


def reference(steps: int) -> dict:
    """Plain single-process AdamW training: each step's loss and gradient norm."""
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms = [], []
    for ids in batches(steps):
        opt.zero_grad()
        loss = loss_fn(model(ids), ids)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item())
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms}


def train_rank(rank: int, steps: int) -> dict:
    """One rank at LAYOUT under SCHEDULE: its stages, losses and global gradient norms."""
    mesh = tpcompile.init_mesh(dp=LAYOUT[0], tp=LAYOUT[1], pp=LAYOUT[2])
    data = batches(steps)
    hm = tpcompile.parallelize_train(build(), mesh, loss_fn=loss_fn, example_inputs=(data[0],), microbatches=2,
                                     schedule=SCHEDULE)
    opt = torch.optim.AdamW(hm.parameters(), lr=1e-2)
    losses, norms = [], []
    for ids in data:
        opt.zero_grad()
        losses.append(hm.step(ids, target=ids).item())
        norms.append(hm.clip_grad_norm_(1e9).item())
        opt.step()
    return {"stages": hm.stage_indices, "losses": losses, "norms": norms}


@pytest.mark.gloo
def test_t5_like_model_trains_across_stages_like_one_process() -> None:
    """2 gloo ranks at (dp, tp, pp) = (1, 1, 2), 4 interleaved stages: every rank's losses and gradient norms
    of 2 steps equal one process's within 1e-6."""
    from tpcompile.runtime import launch
    by_rank = launch(2, train_rank, 2, timeout=240)
    ref = reference(2)
    assert [run["stages"] for run in by_rank] == [[0, 2], [1, 3]]
    for run in by_rank:
        for key in ("losses", "norms"):
            for got, want in zip(run[key], ref[key], strict=True):
                assert abs(got - want) <= 1e-6 * abs(want), (key, run[key], ref[key])
