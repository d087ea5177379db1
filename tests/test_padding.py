"""A vocabulary the world size does not divide is split anyway, zero-padded to a multiple."""
from __future__ import annotations

import copy

import pytest
import torch

import tpcompile
from tpcompile.models import GPT, GPTConfig
from tpcompile.passes.rank_module import local_tensor
from tpcompile.placement import ParamSlice, pad_cuts

from sgd_steps import sgd_losses


def _gpt(vocab: int) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=vocab)).eval()


@pytest.mark.parametrize("ws", [2, 4])
def test_uneven_vocabulary_is_split_and_exact(ws: int) -> None:
    """Vocabulary 250 at 2 and 4 ranks: embedding and tied head split, logits exact, same collectives."""
    model = _gpt(250)
    sm = tpcompile.shard(model, ws)
    assert not sm.plan.warnings
    p = sm.plan.parameters["transformer.wte.weight"]
    assert p.role == "vocab" and p.local_shape == (-(-250 // ws), 64)
    assert sorted(op for op, _ in sm.collectives()) == ["all_gather_replicated"] + ["all_reduce"] * 5
    idx = torch.randint(0, 250, (3, 11))
    with torch.no_grad():
        ref = model(idx)
        for out in tpcompile.simulate(sm, idx):
            assert out.shape == ref.shape
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_uneven_vocabulary_gradients_are_slices_with_zero_padding() -> None:
    """Each rank's embedding gradient is its slice of the full one, the padding rows zero."""
    model = _gpt(250).train()
    ref = copy.deepcopy(model)
    sm = tpcompile.shard(model, 4)
    ranks = [sm.rank(r) for r in range(4)]
    idx = torch.randint(0, 250, (2, 16))
    ref(idx).pow(2).mean().backward()
    full = ref.transformer.wte.weight.grad

    def grad(r: int) -> torch.Tensor:
        ranks[r](idx).pow(2).mean().backward()
        return ranks[r].get_parameter("transformer.wte.weight").grad

    grads = tpcompile.simulate_ranks(4, grad)
    for r, g in enumerate(grads):
        want = local_tensor(full, ParamSlice(0, cuts=pad_cuts(252, 4)), r, 4)
        torch.testing.assert_close(g, want, atol=1e-6, rtol=1e-4)
    assert float(grads[3][-2:].abs().max()) == 0.0  # rows 250 and 251 are padding


def test_uneven_vocabulary_sharded_output_keeps_padding_at_the_end() -> None:
    """With the head's output left split, the last rank's slice ends in zero-padded logits."""
    model = _gpt(250)
    sm = tpcompile.shard(model, 4, plan={"lm_head": "sharded_output"})
    idx = torch.randint(0, 250, (2, 7))
    with torch.no_grad():
        outs = tpcompile.simulate(sm, idx)
        ref = model(idx)
    joined = torch.cat(outs, dim=-1)
    assert joined.shape[-1] == 252
    torch.testing.assert_close(joined[..., :250], ref, atol=1e-5, rtol=0)
    assert float(joined[..., 250:].abs().max()) == 0.0


class SigmoidMLP(torch.nn.Module):
    """An MLP whose activation is not zero at zero (sigmoid(0) = 0.5), its width 50 padded to 52 at 4 ranks."""

    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 50), torch.nn.Linear(50, 8, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.sigmoid(self.up(x)))


@pytest.mark.parametrize("bias", [True, False])
def test_padding_that_is_not_zero_gives_a_row_split_no_gradient(bias: bool) -> None:
    """The padded features after sigmoid hold 0.5, not zeros: the row split zeroes them before its matmul (its sum
    reduced at once, or, without a bias, left pending), so the padded columns of its weight get no gradient and
    stay zero, and two SGD steps on every rank give the unsharded model's output after two steps."""
    torch.manual_seed(0)
    model = SigmoidMLP(bias)
    sm = tpcompile.shard(copy.deepcopy(model), 4, example_inputs=(torch.randn(2, 8),))
    assert sm.plan.parameters["down.weight"].padded == 52
    ranks = [sm.rank(r) for r in range(4)]
    x, probe = torch.randn(3, 8), torch.randn(5, 8)

    def train(r: int) -> tuple:
        opt = torch.optim.SGD(ranks[r].parameters(), lr=0.5)
        for _ in range(2):
            opt.zero_grad()
            ranks[r](x).square().sum().backward()
            grad = ranks[r].down.weight.grad.clone()
            opt.step()
        with torch.no_grad():
            return grad, ranks[r](probe)

    results = tpcompile.simulate_ranks(4, train)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(2):
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()
    with torch.no_grad():
        want = model(probe)
    assert results[3][0][:, 11:].abs().max() == 0  # rank 3 holds features 39..49 and 2 padded ones
    for _, out in results:
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


class SummedMLP(torch.nn.Module):
    """An MLP whose padded hidden features are also summed (a statistic over the padded dim, reduced from the
    ranks' local sums): the sum's gradient at the padding is 1, not 0."""

    def __init__(self, combine: str) -> None:
        super().__init__()
        self.combine = combine
        self.up, self.down = torch.nn.Linear(8, 50, bias=False), torch.nn.Linear(50, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        stat = h.sum(-1, keepdim=True) if self.combine == "sum" else h.mean(-1, keepdim=True)
        return self.down(torch.relu(h)) + stat


@pytest.mark.parametrize("combine", ["sum", "mean"])
def test_a_sum_over_padding_gives_it_no_gradient(combine: str) -> None:
    """The padded features are zeros, so the ranks' local sums add up to the real sum; the sum passes no gradient
    back to the padding either, so the padded rows of the weight that made it stay zero and three SGD steps on
    every rank give the unsharded model's losses (they drifted from the second step)."""
    torch.manual_seed(0)
    model = SummedMLP(combine)
    sm = tpcompile.shard(copy.deepcopy(model), 4, example_inputs=(torch.randn(2, 8),))
    assert sm.plan.parameters["up.weight"].padded == 52 and not sm.plan.replicated
    ranks = [sm.rank(r) for r in range(4)]
    xs = [torch.randn(3, 8) for _ in range(3)]

    results = tpcompile.simulate_ranks(4, lambda r: sgd_losses(ranks[r], xs, 0.1))
    want = sgd_losses(model, xs, 0.1)
    assert ranks[3].get_parameter("up.weight")[11:].abs().max() == 0  # rank 3: features 39..49, 2 padded rows
    for losses in results:
        assert losses == pytest.approx(want, rel=1e-5)


@pytest.mark.gloo
def test_a_sum_over_padding_trains_under_torchrun_like_one_process() -> None:
    """examples/train_hybrid.py at tp 4 under torchrun (4 gloo processes, AdamW) on a model that sums its padded
    hidden width: four steps' losses equal one process's (4.5 % off from the second step when the sum passed its
    gradient to the padding)."""
    from hybrid_matrix import TOLERANCE, layout_args, run_example, worst_relative

    args = ["--model", "tests/padded_sum_lm.py:PadLM", "--inputs", "4x16:long", "--steps", "4", "--lr", "0.05",
            "--json"]
    out = run_example([*layout_args(1, 4, 1), *args], nproc=4)
    ref = run_example(["--dp", "1", "--tp", "1", "--pp", "1", *args])
    assert worst_relative(out["losses"], ref["losses"]) < TOLERANCE, (out["losses"], ref["losses"])
