"""The startup agreement and the input check: ranks that disagree are caught before they compute.

The fingerprints are checked in-process; every distributed case runs in one 2-rank gloo launch
(tests/agreement_run.py), where one rank's model, code or inputs differ on purpose: each case ends
equal to rank 0's model, or in the same TPCompileError on both ranks within 30 s.
"""
from __future__ import annotations

import pytest
import torch

import tpcompile
from agreement_run import gpt, results
from tpcompile.runtime.fingerprint import graph_digest, graph_lines, plan_lines, tensor_entries, values_differ
from tpcompile.runtime.input_check import check_inputs_mode

LIMIT_S = 30.0


def _lines(model: torch.nn.Module, shape: tuple[int, int] = (2, 12)) -> list[str]:
    """The captured graph's canonical lines."""
    ids = torch.randint(0, 64, shape, generator=torch.Generator().manual_seed(0))
    return graph_lines(tpcompile.shard(model, 2, example_inputs=(ids,)).captured)


def test_graph_lines_do_not_depend_on_the_example_size() -> None:
    """Two captures of one model at other batch and length read alike, symbols renamed."""
    assert _lines(gpt(0)) == _lines(gpt(1), (3, 9))


def test_graph_lines_name_the_node_where_head_counts_differ() -> None:
    """Another head count with equal parameter shapes differs first at the attention's view, with its module."""
    a, b = _lines(gpt(0)), _lines(gpt(0, n_head=2))
    first = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert "aten.view.default" in a[first] and a[first].endswith("@transformer.h.0.attn")
    assert ", 4, 8]" in a[first] and ", 2, 16]" in b[first]


class _TwoBranches(torch.nn.Module):
    """sin and cos of the input, computed in the order given (as model code iterating a set would)."""

    def __init__(self, order: str) -> None:
        super().__init__()
        self.lin, self.order = torch.nn.Linear(8, 8), order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = {k: (torch.sin(x) if k == "a" else torch.cos(x)) for k in self.order}
        return self.lin(outs["a"] + outs["b"])


def test_graph_digest_ignores_the_order_of_independent_nodes() -> None:
    """The same dataflow with two independent nodes swapped: other line order, the same graph digest."""
    x = torch.randn(2, 8)
    a = graph_lines(tpcompile.shard(_TwoBranches("ab"), 2, example_inputs=(x,)).captured)
    b = graph_lines(tpcompile.shard(_TwoBranches("ba"), 2, example_inputs=(x,)).captured)
    assert a != b and graph_digest(a) == graph_digest(b)


def test_plan_lines_differ_with_the_overrides() -> None:
    """A module replicated by plan= on one rank changes the plan's lines."""
    ids = torch.randint(0, 64, (2, 12))
    plain = tpcompile.shard(gpt(0), 2, example_inputs=(ids,))
    other = tpcompile.shard(gpt(0), 2, example_inputs=(ids,), plan={"transformer.h.0.mlp": "replicate"})
    assert plan_lines(plain.plan, plain.overrides) != plan_lines(other.plan, other.overrides)


def test_value_fingerprints_tell_other_values_apart() -> None:
    """Equal tensors agree; another init, one changed element, or another dtype's bytes differ; meta has no values."""
    a = tensor_entries(gpt(0).named_parameters(), values=True)
    b = tensor_entries(gpt(0).named_parameters(), values=True)
    c = tensor_entries(gpt(1).named_parameters(), values=True)
    assert not any(values_differ(x, y) for x, y in zip(a, b))
    assert values_differ(a[0], c[0])
    t = torch.randn(5000, generator=torch.Generator().manual_seed(0))
    u = t.clone()
    u[1] += 0.1  # off the sampled elements: the sums still tell (1e-5 relative is the limit)
    assert values_differ(*tensor_entries([("t", t), ("t", u)], values=True))
    bf = tensor_entries([("w", torch.randn(3, 3).bfloat16())], values=True)[0]
    assert bf.stats is not None and bf.sample is not None
    assert tensor_entries([("w", torch.empty(2, device="meta"))], values=True)[0].stats is None


def test_check_inputs_mode_is_checked() -> None:
    """An unknown check_inputs value is a TPCompileError listing the accepted ones."""
    with pytest.raises(tpcompile.TPCompileError, match="'first', 'always', 'never'"):
        check_inputs_mode("sometimes")


def _both(part: str, case: str) -> list[dict]:
    """The case's result on both ranks."""
    return [r[part][case] for r in results()]


def _same_error(part: str, case: str, *words: str) -> str:
    """Both ranks raised the same TPCompileError within LIMIT_S, naming every word; the message."""
    a, b = _both(part, case)
    assert "error" in a and "error" in b, (a, b)
    assert a["error"] == b["error"]
    assert a["s"] < LIMIT_S and b["s"] < LIMIT_S
    for w in words:
        assert w in a["error"], (w, a["error"])
    return a["error"]


@pytest.mark.gloo
def test_unseeded_parallelize_computes_rank_0s_model() -> None:
    """Each rank built its own random init: both compute rank 0's model, and rank 0 logs one line saying so."""
    a, b = _both("parallelize", "unseeded")
    assert a["value"] < 1e-5 and b["value"] < 1e-5
    log0, log1 = results()[0]["parallelize"]["unseeded_log"], results()[1]["parallelize"]["unseeded_log"]
    assert len(log0) == 1 and "differ between ranks" in log0[0] and "rank 0's values" in log0[0]
    assert log1 == []


@pytest.mark.gloo
def test_other_code_with_equal_shapes_raises_naming_the_node() -> None:
    """Another head count, or another activation: a TPCompileError on both ranks naming the op and module."""
    _same_error("parallelize", "heads", "captured different programs", "aten.view.default", "transformer.h.0.attn")
    _same_error("parallelize", "activation", "aten.gelu.default", "aten.relu.default")


@pytest.mark.gloo
def test_an_extra_layer_raises_naming_the_tensor() -> None:
    """One rank with a third block: both ranks raise naming the first tensor where the models part."""
    _same_error("parallelize", "extra_layer", "hold different models", "transformer.h.2.ln_1.weight",
                "rank 0 holds 29 parameters and buffers, rank 1 41")


@pytest.mark.gloo
def test_unequal_inputs_raise_naming_the_input() -> None:
    """Different ids per rank: the first call raises naming the input; with check_inputs='always' any call does."""
    _same_error("parallelize", "inputs", "different inputs", "input idx (4x12 int64)", "rank 1")
    _same_error("parallelize", "inputs_always", "different inputs", "input idx")


@pytest.mark.gloo
def test_comm_passes_run_under_parallelize() -> None:
    """parallelize(..., comm=True) agrees at startup (the bucket op read) and equals the model."""
    assert all(r["parallelize"]["comm"] < 1e-5 for r in results())


@pytest.mark.gloo
def test_generation_agrees_on_weights_and_prompts() -> None:
    """shard_generation adopts rank 0's weights (HF-equal tokens) and refuses different prompts naming them."""
    assert all(r["value"] is True for r in _both("generate", "unseeded"))
    _same_error("generate", "prompts", "RankGenerator.generate", "input_ids")


@pytest.mark.gloo
def test_unseeded_fsdp_trains_rank_0s_model() -> None:
    """Under FSDP with each rank's own init, the first loss is rank 0's model's on the whole batch."""
    for r in results():
        loss = r["train"]["unseeded_fsdp"]["value"][0]
        assert abs(loss - r["train"]["unseeded_reference"]) < 1e-5 * abs(loss)


@pytest.mark.gloo
def test_parallelize_train_refuses_ranks_that_disagree() -> None:
    """An extra layer at pp 2, another head count at tp 2, unequal batches at tp 2: one TPCompileError each."""
    _same_error("train", "extra_layer_pp", "tpcompile.parallelize_train", "transformer.h.2.ln_1.weight")
    _same_error("train", "heads_tp", "tpcompile.parallelize_train", "aten.view.default")
    _same_error("train", "inputs_tp", "HybridModel.step", "input idx", "rank 1")


@pytest.mark.gloo
def test_parallelize_train_keeps_the_capture_guards() -> None:
    """A length-dependent branch, or a GPT past its position table, stepped at another length: shard()'s guard error."""
    _same_error("train", "branch_pp", "condition the capture assumed", "ids.size()[1] <= 16")
    _same_error("train", "past_table_pp", "condition the capture assumed", "idx.size()[1] <= 32")
