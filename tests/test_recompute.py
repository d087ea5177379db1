"""Activation checkpointing of rank graphs: per block and selective, equal gradients, less kept, nothing run twice."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tpcompile
from tpcompile.hybrid.pieces import find_blocks
from tpcompile.models import GPT, GPTConfig
from tpcompile.ops.collectives import record
from tpcompile.passes.recompute import checkpoint_blocks, checkpoint_selective, recompute_mode

aten = torch.ops.aten


class _Count(TorchDispatchMode):
    """Counts the calls of a few ops."""

    def __init__(self, ops: set) -> None:
        super().__init__()
        self.ops, self.calls = ops, {op: 0 for op in ops}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func in self.ops:
            self.calls[func] += 1
        return func(*args, **(kwargs or {}))


def _run(mode: str | None, dropout: float = 0.0, comm: object = None) -> list[dict]:
    """Each of 2 simulated ranks: gradients, bytes kept for backward, op and collective counts in backward."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, dropout=dropout)).train()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    sm = tpcompile.shard(model, 2, example_inputs=(ids,), comm=comm)
    for r in range(2):
        if mode == "blocks":
            checkpoint_blocks(sm.rank(r), find_blocks(model))
        elif mode == "selective":
            checkpoint_selective(sm.rank(r))

    def run(r: int) -> dict:
        gm, kept = sm.rank(r), []

        def pack(t: torch.Tensor) -> torch.Tensor:
            kept.append(t.numel() * t.element_size())
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = gm(ids)
        counter = _Count({aten.gelu.default, aten.mm.default, aten.addmm.default})
        with record() as events, counter:
            out.square().mean().backward()
        return {"grads": {n: p.grad for n, p in gm.named_parameters()}, "kept": sum(kept),
                "backward_calls": dict(counter.calls), "backward_collectives": sum(e.rank == r for e in events),
                "state": sorted(gm.state_dict())}
    return tpcompile.simulate_ranks(2, run)


@pytest.fixture(scope="module")
def plain() -> list[dict]:
    """The ranks without activation checkpointing."""
    return _run(None)


@pytest.mark.parametrize("mode", ["blocks", "selective"])
def test_checkpointing_keeps_the_gradients_and_the_names(plain: list[dict], mode: str) -> None:
    """Every gradient as without checkpointing; the rank module's state dict names unchanged."""
    for got, want in zip(_run(mode), plain):
        assert got["state"] == want["state"]
        for name, g in want["grads"].items():
            assert torch.allclose(got["grads"][name], g, rtol=1e-5, atol=1e-7), name


def test_selective_sums_functionally_under_the_default_and_async_passes(plain: list[dict]) -> None:
    """Selective checkpointing keeps matmul outputs, so the default in-place (and opt-in async) all-reduces become
    functional ones: none left in the graph, and every gradient as without checkpointing."""
    reduce = torch.ops.tpcompile.all_reduce
    for comm in (None, tpcompile.CommOptions(asynchronous=True)):
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=2)).train()
        gm = tpcompile.shard(model, 2, example_inputs=(torch.zeros(2, 16, dtype=torch.long),), comm=comm).rank(0)
        assert any(n.target in (reduce.inplace, reduce.start) for n in gm.graph.nodes)
        checkpoint_selective(gm)
        targets = {n.target for n in gm.graph.nodes}
        assert reduce.default in targets and not targets & {reduce.inplace, reduce.start,
                                                            torch.ops.tpcompile_async.wait.default}
        for got, want in zip(_run("selective", comm=comm), plain):
            for name, g in want["grads"].items():
                assert torch.allclose(got["grads"][name], g, rtol=1e-5, atol=1e-7), (comm, name)


def test_blocks_keep_less_and_recompute_their_ops(plain: list[dict]) -> None:
    """Per block: fewer bytes kept for backward, each block's gelu and matmuls run again, collectives too."""
    for got, want in zip(_run("blocks"), plain):
        assert got["kept"] < 0.75 * want["kept"]
        assert got["backward_calls"][aten.gelu.default] == want["backward_calls"][aten.gelu.default] + 2
        assert got["backward_collectives"] > want["backward_collectives"]  # the blocks' all-reduces run again


def test_selective_recomputes_pointwise_ops_only(plain: list[dict]) -> None:
    """Selective: the gelus run again in backward; matmuls and collectives do not."""
    for got, want in zip(_run("selective"), plain):
        assert got["backward_calls"][aten.gelu.default] == want["backward_calls"][aten.gelu.default] + 2
        mm = (aten.mm.default, aten.addmm.default)
        assert sum(got["backward_calls"][o] for o in mm) == sum(want["backward_calls"][o] for o in mm)
        assert got["backward_collectives"] == want["backward_collectives"]


def test_blocks_refuse_live_dropout_and_selective_keeps_its_masks() -> None:
    """Per block with dropout on: a TPCompileError pointing to 'selective'; selective runs with dropout."""
    with pytest.raises(tpcompile.TPCompileError, match="use activation_checkpointing='selective'"):
        _run("blocks", dropout=0.1)
    assert all(r["grads"] for r in _run("selective", dropout=0.1))


def test_recompute_mode_names_the_accepted_values() -> None:
    """True means per block; an unknown value is a TPCompileError."""
    assert recompute_mode(True) == "blocks" and recompute_mode(False) is None
    with pytest.raises(tpcompile.TPCompileError, match="'selective'"):
        recompute_mode("some")
