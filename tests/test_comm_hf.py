"""The communication passes on the Hugging Face architectures of tests/hf_models.py: sharded with the default
passes (`comm=None`: in-place sums, buckets) and with `CommOptions(asynchronous=True)` (those, fused linear
gradients, start/wait), every rank's no-grad output, training output and parameter gradients equal those of the
same split without the passes (`comm=False`).

The passes reorder nodes; a real model's graph holds what small test models do not (dtype casts that leave
assertions nothing reads, splits of fused multi-query weights shared by several bucketed pieces). A few
architectures, one per idiom that needed a fix, run in the default suite; the rest are marked slow
(pytest -m slow), with and without sequence parallelism.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import tpcompile

pytest.importorskip("transformers")
from hf_models import ARCHS, NEW_ARCHS, Arch, build, inputs  # noqa: E402

tp = torch.ops.tpcompile
PASSED = (tp.all_reduce.start, tp.all_reduce.inplace, tp.grad_bucket_all_reduce.default,
          tp.linears_grad_all_reduce.default)  # what the passes emit
# llama (a norm's float32 cast reads a sum first), falcon (k and v pieces of one split, bucketed), bert (encoder)
FAST = ("llama", "falcon", "bert")
# unrolled scan: runs only at its captured length (docs/architectures.md)
FIXED_LENGTH = ("falcon_mamba",)
ALL = [a for a in ARCHS + NEW_ARCHS if a.name not in FIXED_LENGTH]


def _run(sm: tpcompile.ShardedModel, arch: Arch, kw: dict) -> list:
    def one(rank: int) -> tuple:
        gm = sm.rank(rank)
        with torch.no_grad():
            still = gm(**kw)[arch.output]
        gm.zero_grad(set_to_none=True)
        out = gm(**kw)[arch.output]
        out.float().pow(2).mean().backward()
        return still, out.detach(), {n: p.grad for n, p in gm.named_parameters() if p.grad is not None}
    return tpcompile.simulate_ranks(sm.world_size, one)


COMMS = {"default": None, "async": tpcompile.CommOptions(asynchronous=True)}  # against comm=False


def _check(arch: Arch, sequence_parallel: bool, comm: str = "async") -> None:
    model = build(arch)
    kw = inputs(arch, 2, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tpcompile.TPCompileWarning)
        plain, fast = (tpcompile.shard(model, 2, example_kwargs=kw, sequence_parallel=sequence_parallel, comm=c)
                       for c in (False, COMMS[comm]))
    emitted = {n.target for n in fast.rank(0).graph.nodes} & set(PASSED)
    assert emitted, "the passes changed nothing: nothing to check"
    assert not {n.target for n in plain.rank(0).graph.nodes} & set(PASSED), "comm=False ran a pass"
    if not sequence_parallel:  # its forward sums are reduce-scatters: no start/wait there
        assert (tp.all_reduce.start if comm == "async" else tp.all_reduce.inplace) in emitted
    torch.manual_seed(3)  # the same dropout masks (none in eval mode) and a new batch
    run = inputs(arch, 3, 8)
    for r, (got, want) in enumerate(zip(_run(fast, arch, run), _run(plain, arch, run))):
        where = f"{arch.name}, rank {r}"
        torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=0, msg=lambda m: f"{where}, no grad: {m}")
        torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=0, msg=lambda m: f"{where}, training: {m}")
        assert got[2].keys() == want[2].keys() and got[2], where
        for name in want[2]:
            torch.testing.assert_close(got[2][name], want[2][name], atol=1e-6, rtol=0,
                                       msg=lambda m, name=name: f"{where}, gradient of {name}: {m}")


@pytest.mark.parametrize("comm", list(COMMS))
@pytest.mark.parametrize("arch", [a for a in ALL if a.name in FAST], ids=lambda a: a.name)
def test_comm_passes_equal_the_plain_split(arch: Arch, comm: str) -> None:
    """Outputs (no grad and training) and every gradient equal the split without the passes, within 1e-6."""
    _check(arch, sequence_parallel=False, comm=comm)


@pytest.mark.slow
@pytest.mark.parametrize("comm", list(COMMS))
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("arch", ALL, ids=lambda a: a.name)
def test_comm_passes_equal_the_plain_split_slow(arch: Arch, sequence_parallel: bool, comm: str) -> None:
    """The same for every architecture, with and without sequence parallelism."""
    _check(arch, sequence_parallel, comm)
