"""check_gradients and `tpcompile verify --train`: every rank's loss and gradients against the original model's."""
from __future__ import annotations

import copy
import dataclasses
import functools
import warnings
from typing import Any

import pytest
import torch
from torch import fx, nn

import tpcompile
from tpcompile.api import ShardedModel, shard_captured
from tpcompile.capture.export import capture
from tpcompile.cli import main
from tpcompile.models import GPT, GPTConfig, build
from tpcompile.passes.pass_context import module_path

aten = torch.ops.aten
BUNDLED = ["mlp", "gpt", "gpt-manual", "gpt-sep"]


@functools.lru_cache(maxsize=None)
def _captured(name: str) -> tuple[nn.Module, Any]:
    """A bundled model and its capture, made once per module for both world sizes."""
    model = build(name)
    return model, capture(model, model.example_inputs(), None, None)


def _bundled(name: str, ws: int) -> tuple[nn.Module, ShardedModel, tuple]:
    """The bundled model sharded at `ws` from its own copy of the capture (the passes annotate it in place)."""
    model, cap = _captured(name)
    with warnings.catch_warnings():  # copying the graph's pytree spec warns about a torch-internal alias
        warnings.simplefilter("ignore", FutureWarning)
        gm = copy.deepcopy(cap.gm)
    return model, shard_captured(dataclasses.replace(cap, gm=gm), ws), model.example_inputs()


def _double_grad(gm: fx.GraphModule, name: str) -> None:
    """Make the gradient of parameter `name` twice what it should be in gm's backward, forward unchanged:
    p + (p - detach(p)) is p, and its derivative is 2."""
    g = gm.graph
    node = next(n for n in g.nodes if n.op == "get_attr" and n.target == name)
    with g.inserting_after(node):
        frozen = g.call_function(aten.detach.default, (node,))
    with g.inserting_after(frozen):
        zero = g.call_function(aten.sub.Tensor, (node, frozen))
    with g.inserting_after(zero):
        twice = g.call_function(aten.add.Tensor, (node, zero))
    node.replace_all_uses_with(twice, delete_user_cb=lambda user: user not in (frozen, zero, twice))
    gm.recompile()


def _drop_grad_all_reduce(gm: fx.GraphModule, module: str) -> None:
    """Erase the grad_all_reduce in front of the column split `module`: its input gradient is no longer summed."""
    node = next(n for n in gm.graph.nodes
                if n.target is torch.ops.tpcompile.grad_all_reduce.default and module_path(n) == module)
    node.replace_all_uses_with(node.args[0])
    gm.graph.erase_node(node)
    gm.recompile()


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_models_pass(name: str, ws: int) -> None:
    """Every bundled model's loss, output and parameter gradients agree on every rank, and no .grad is left."""
    model, sm, args = _bundled(name, ws)
    report = tpcompile.check_gradients(model, sm, *args)
    assert report.ok, str(report)
    assert report.lines()[-1].startswith("OK: every gradient agrees")
    used = [g for g in report.gradients if not g.unused]
    assert len(used) == len({id(p) for p in model.parameters()})
    assert any(g.split.startswith(("column", "row", "vocab")) for g in used)
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is None for r in range(ws) for p in sm.rank(r).parameters())


def test_one_parameter_gradient_wrong_on_one_rank_is_named() -> None:
    """Rank 1's doubled gradient of one row-split weight is the only mismatch, named with rank 1 alone."""
    model, sm, args = _bundled("gpt", 2)
    name = "transformer.h.0.mlp.c_proj.weight"
    _double_grad(sm.rank(1), name)
    report = tpcompile.check_gradients(model, sm, *args)
    assert not report.ok and report.loss.ok and all(o.ok for o in report.outputs)
    assert [g.name for g in report.mismatches] == [name]
    bad = report.mismatches[0]
    assert bad.bad_ranks == [1] and bad.diffs[1] > 100 * bad.allowed and bad.diffs[0] <= bad.allowed
    assert report.verdict().startswith(f"FAIL: gradient of {name} on rank 1: max |grad diff| ")
    assert f"{name} (64x256, row@1): " in str(report) and "MISMATCH on rank 1" in str(report)


def test_unsummed_column_input_gradient_is_caught() -> None:
    """Without the grad_all_reduce before h.1's c_fc, the parameters before it are wrong and those after it agree."""
    model, sm, args = _bundled("gpt", 2)
    for r in range(2):  # on every rank, so that the ranks still issue the same collectives
        _drop_grad_all_reduce(sm.rank(r), "transformer.h.1.mlp.c_fc")
    report = tpcompile.check_gradients(model, sm, *args)
    wrong = {g.name for g in report.mismatches}
    assert {"transformer.h.1.ln_2.weight", "transformer.h.1.ln_2.bias", "transformer.h.0.mlp.c_fc.weight"} <= wrong
    after = {"transformer.h.1.mlp.c_fc.weight", "transformer.h.1.mlp.c_proj.weight", "transformer.ln_f.weight"}
    assert not wrong & after
    pos = "transformer.wpe.weight"  # split by rows: the 16 positions read are rank 0's, rank 1's rows get none
    assert all(g.bad_ranks == [0, 1] for g in report.mismatches if g.name != pos)
    assert [g.bad_ranks for g in report.mismatches if g.name == pos] == [[0]]


def test_missing_gradient_on_a_rank_is_a_mismatch() -> None:
    """A parameter rank 1 reads detached has no gradient there: a mismatch that says so."""
    model, sm, args = _bundled("mlp", 2)
    g = sm.rank(1).graph
    node = next(n for n in g.nodes if n.op == "get_attr" and n.target == "layers.0.weight")
    with g.inserting_after(node):
        frozen = g.call_function(aten.detach.default, (node,))
    node.replace_all_uses_with(frozen, delete_user_cb=lambda user: user is not frozen)
    sm.rank(1).recompile()
    report = tpcompile.check_gradients(model, sm, *args)
    assert [(g.name, g.bad_ranks) for g in report.mismatches] == [("layers.0.weight", [1])]
    assert "no gradient on this rank, but the original has one" in report.verdict()


@pytest.mark.parametrize("ws", [2, 3])
def test_sharded_output_head_passes(ws: int) -> None:
    """lm_head left split (at 3 ranks a padded vocabulary): each rank's loss term uses its slice, and all agree;
    a loss_fn, which needs whole outputs, is refused naming the split output."""
    model = build("gpt")
    (ids,) = model.example_inputs()
    with warnings.catch_warnings():  # at 3 ranks the 4 heads stay whole: warned, not what this test is about
        warnings.simplefilter("ignore", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, ws, example_inputs=(ids,), plan={"lm_head": "sharded_output"})
    report = tpcompile.check_gradients(model, sm, ids, seed=3)
    assert report.ok, str(report)
    assert "each rank holds a slice" in report.lines()[0]
    assert ("(padded to 258)" in report.lines()[0]) == (ws == 3)
    assert report.loss.worst < 1e-4 * abs(report.loss.reference)
    with pytest.raises(tpcompile.TPCompileError, match="loss_fn needs whole outputs, but output output stays split"):
        tpcompile.check_gradients(model, sm, ids, loss_fn=lambda logits: logits.sum())


def test_custom_loss_fn() -> None:
    """A next-token cross-entropy as loss_fn: the loss and every gradient agree at 2 ranks."""
    model, sm, args = _bundled("gpt", 2)
    ids = args[0]
    ce = lambda logits: nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())  # noqa: E731
    report = tpcompile.check_gradients(model, sm, ids, loss_fn=ce)
    assert report.ok, str(report)
    with torch.no_grad():
        assert report.loss.reference == pytest.approx(float(ce(model(ids))), rel=1e-6)


class BatchNormMLP(nn.Module):
    """A Linear, BatchNorm in training mode (its forward writes the running statistics), a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.bn, self.down = nn.Linear(8, 32), nn.BatchNorm1d(32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.bn(torch.relu(self.up(x))))


def test_under_no_grad_and_buffers_put_back() -> None:
    """Called under torch.no_grad(), gradients are still taken on every rank; the running statistics the
    forwards write are back to their values afterwards, on the model and on the ranks."""
    model = BatchNormMLP().train()
    x = torch.randn(6, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, 2, example_inputs=(x,))
    before = [b.clone() for m in (model, sm.rank(0), sm.rank(1)) for b in m.buffers()]
    with torch.no_grad():
        report = tpcompile.check_gradients(model, sm, x)
    assert report.ok and not any(g.unused for g in report.gradients), str(report)
    after = [b for m in (model, sm.rank(0), sm.rank(1)) for b in m.buffers()]
    assert len(after) == 9 and all(torch.equal(a, b) for a, b in zip(before, after))


def test_live_dropout_is_refused() -> None:
    """A GPT captured in training mode with dropout 0.1 is refused with a TPCompileError naming the dropout."""
    model = GPT(GPTConfig(n_layer=1, dropout=0.1)).train()
    (ids,) = model.example_inputs()
    sm = tpcompile.shard(model, 2, example_inputs=(ids,))
    with pytest.raises(tpcompile.TPCompileError,
                       match=r"live dropout: dropout \(p=0.1\) at transformer\.drop .*model\.eval\(\)"):
        tpcompile.check_gradients(model, sm, ids)


def test_cli_train_ok_and_broken_rank_exits_1(capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """`verify mlp --train` prints a line per gradient and OK (exit 0); with rank 1's gradient of one weight
    doubled, `check --train` exits 1 naming that weight and rank 1."""
    assert main(["verify", "mlp", "--train", "-w", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("verify --train MLPStack (mlp) at world size 2 on random inputs (4x64 float32, seed 1)")
    assert any(line.startswith("layers.0.weight (256x64, column@0): max |grad diff| ") for line in lines)
    assert lines[-1].startswith("OK: every gradient agrees")
    build_rank = ShardedModel.rank

    def broken(self: ShardedModel, r: int) -> fx.GraphModule:
        """Rank 1 doubles the gradient of layers.2.weight."""
        gm = build_rank(self, r)
        if r == 1 and not getattr(gm, "_doubled", False):
            _double_grad(gm, "layers.2.weight")
            gm._doubled = True
        return gm

    monkeypatch.setattr(ShardedModel, "rank", broken)
    assert main(["check", "mlp", "--train", "-w", "2", "--seed", "5"]) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("FAIL: gradient of layers.2.weight on rank 1: max |grad diff| "), last


def _hf_case(arch_name: str, ws: int) -> None:
    """One Hugging Face architecture: shard at batch 2 x 8, check gradients at batch 3 x 8."""
    from hf_models import ALL_ARCHS, build as build_hf, inputs
    arch = next(a for a in ALL_ARCHS if a.name == arch_name)
    model = build_hf(arch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, ws, example_kwargs=inputs(arch, 2, 8))
    torch.manual_seed(1)
    report = tpcompile.check_gradients(model, sm, **inputs(arch, 3, 8))
    assert report.ok, str(report)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(("arch", "ws"), [("gpt2", 2), ("llama", 4)])
def test_hf_architectures_pass(arch: str, ws: int) -> None:
    """GPT-2 (fused q|k|v, tied head) at 2 ranks and Llama (2 kv heads shared by 2 ranks each) at 4 agree."""
    pytest.importorskip("transformers")
    _hf_case(arch, ws)


def _all_archs() -> list[str]:
    """The names of every architecture in tests/hf_models.py (none without transformers)."""
    try:
        from hf_models import ALL_ARCHS
    except ImportError:
        return []
    return [a.name for a in ALL_ARCHS]


@pytest.mark.slow
@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("arch", _all_archs())
def test_every_hf_architecture_passes(arch: str, ws: int) -> None:
    """Every Hugging Face architecture of tests/hf_models.py agrees at 2 and 4 ranks."""
    pytest.importorskip("transformers")
    _hf_case(arch, ws)
