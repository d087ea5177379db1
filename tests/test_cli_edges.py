"""The command line at a newcomer's edges: tolerances, split outputs, missing or unfit inputs, warnings, blocks."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import tpcompile
from tpcompile.cli import main
from tpcompile.cli.compare import check_outputs
from tpcompile.cli.failures import command_line_hint, concrete_sizes
from tpcompile.models.spec import load_model
from tpcompile.models import build
from tpcompile.report.plan_table import plan_report
from tpcompile.report.trace import trace
from tpcompile.report.wording import placements_in_words, short_warning

MODELS = '''
import torch
from torch import nn


class Loud(nn.Module):
    """A small LM whose logits reach the hundreds: a sharded sum's rounding grows with them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(64, 64)
        self.up = nn.Linear(64, 256)
        self.down = nn.Linear(256, 64)
        self.head = nn.Linear(64, 64, bias=False)
        with torch.no_grad():
            self.head.weight.mul_(200.0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + self.down(torch.relu(self.up(h)))
        return self.head(h)

    def example_inputs(self) -> tuple:
        return (torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0)),)


class Tokens(nn.Module):
    """Token ids in, no example_inputs()."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.fc = nn.Linear(16, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(ids))


class Encoder(nn.Module):
    """nn.TransformerEncoderLayer: attention through nn.MultiheadAttention."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def example_inputs(self) -> tuple:
        return (torch.randn(2, 5, 32),)

'''


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model file."""
    path = tmp_path_factory.mktemp("edges") / "edges.py"
    path.write_text(MODELS)
    return path


def _error(capsys: pytest.CaptureFixture[str]) -> str:
    """The one error line on stderr (stdout empty)."""
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_verify_tolerance_scales_with_the_output(capsys: pytest.CaptureFixture[str], models: Path) -> None:
    """Logits in the hundreds differ by more than 1e-5 at 4 ranks yet pass; --atol/--rtol override the scale."""
    assert main(["verify", f"{models}:Loud", "-w", "4"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    worst = float(lines[1].split("max |diff| ")[1].split(",")[0])
    relative = float(lines[1].split("relative ")[1].split(",")[0])
    assert worst > 1e-5 and relative < 1e-6  # rounding of large values: a fixed 1e-5 would call it a failure
    assert lines[-1].startswith("OK: ") and "= atol 1e-05 + rtol 1.3e-06 x max |output| " in lines[-1]
    assert main(["verify", f"{models}:Loud", "-w", "4", "--rtol", "0"]) == 1
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("FAIL: ")
    assert main(["verify", f"{models}:Loud", "-w", "4", "--atol", "1e-3", "--rtol", "0"]) == 0


@pytest.mark.filterwarnings("ignore::tpcompile.TPCompileWarning")  # 3 ranks replicate some attention
def test_verify_compares_a_split_output_slice_by_slice(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """lm_head: sharded_output at 3 ranks (vocabulary 256 padded to 258): each rank matches its slice, exit 0."""
    plan = tmp_path / "plan.yaml"
    plan.write_text("lm_head: sharded_output\n")
    assert main(["verify", "gpt", "-w", "3", "--plan", str(plan)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "each rank holds a slice, split along dim 2 (padded to 258)" in lines[1]
    assert lines[-1].startswith("OK: ")
    # numerical twin: the same ranks' outputs in the wrong order fail the same comparison
    model = build("gpt")
    sm = tpcompile.shard(model, 3, plan={"lm_head": "sharded_output"})
    (idx,) = model.example_inputs()
    with torch.no_grad():
        ref, outs = model(idx), tpcompile.simulate(sm, idx)
    assert [o.shape[-1] for o in outs] == [86, 86, 86]
    assert all(c.ok for c in check_outputs(ref, outs, sm))
    assert not any(c.ok for c in check_outputs(ref, [outs[1], outs[0], outs[2]], sm))


def test_inputs_checked_against_the_model(capsys: pytest.CaptureFixture[str], models: Path) -> None:
    """Float inputs for token ids, ids beyond the vocabulary: one line each with the spec to write, exit 2."""
    assert main(["plan", "gpt", "--inputs", "2x16"]) == 2
    line = _error(capsys)
    assert "takes integer token ids there" in line and "write --inputs 2x16:long" in line
    assert "dynamic_shapes" not in line
    assert main(["verify", "gpt", "--inputs", "2x16:long:100000"]) == 2
    line = _error(capsys)
    assert "ids up to 99999" in line and "transformer.wte has 256 rows" in line and "2x16:long:256" in line
    assert main(["plan", f"{models}:Tokens"]) == 2
    assert "e.g. --inputs 2x8:long (its first layer emb is an Embedding of 32 rows)" in _error(capsys)


def test_capture_failures_in_concrete_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    """A model that fails unsharded says so with its own concrete message; torch's size symbols never show."""
    assert main(["plan", "gpt", "--inputs", "2x100:long"]) == 2
    line = _error(capsys)
    assert "fails on its inputs (2x100 int64) even unsharded" in line
    assert "sequence length 100 exceeds block_size 64" in line
    assert not re.search(r"\bs\d+\b", line)
    text = concrete_sizes("expected torch.Size([s77, s27, 64]), got s75 rows", "2x100 int64")
    assert text == ("expected [?, ?, 64], got a dynamic size rows (? and 'a dynamic size' stand for sizes of the "
                    "inputs, which were 2x100 int64)")
    hint = command_line_hint("try: example inputs that take the model's usual path; dynamic_shapes=... to fix a "
                             "dimension that cannot vary (e.g. dynamic_shapes={'x': None}); torch.cond for ...")
    assert hint.startswith("try: --inputs that take") and "tpcompile.shard(..., dynamic_shapes=...) from Python" in hint


def test_plan_shows_each_warning_once_in_words(capsys: pytest.CaptureFixture[str]) -> None:
    """At 3 ranks each replicated module is one line under the tables, without placement notation; --debug has
    the long form (q, k and v normalised over their padded heads by LayerNorms without a weight)."""
    normed = [f"{Path(__file__).parent / 'test_soundness.py'}:HeadsNotDivisible", "-w", "3", "--inputs", "2x5x48"]
    assert main(["plan", *normed]) == 0
    out, err = capsys.readouterr()
    assert "warning" not in err
    notes = out.split("backward-only markers")[1].splitlines()[1:]
    replicated = [line for line in notes if line.startswith("replicated ")]
    assert replicated and notes[-1] == "(--debug shows each reason as the compiler wrote it)"
    modules = [line.split(":")[0].removeprefix("replicated ") for line in replicated]
    assert len(modules) == len(set(modules))
    assert all(out.count(f"replicating {m}") == 0 for m in modules)
    assert not re.search(r"\bS\(\d|\bis R\b|results stay exact", "\n".join(notes))
    assert main(["plan", *normed, "--debug"]) == 0
    assert "results stay exact" in capsys.readouterr().out


def test_placement_words() -> None:
    """Placement notation and a propagation warning read as words."""
    assert placements_in_words("input dropout is R but the op needs S(2~66)") == (
        "input dropout is whole on every rank but the op needs it split along dim 2 (padded to 66)")
    assert placements_in_words("(S(0|64+64+64), R)") == (
        "(split along dim 0 (each of the segments 64, 64, 64 split), whole on every rank)")
    warning = ("aten.add.Tensor (add_1) at transformer.h.0: input dropout is R but the op needs S(2); replicating "
               "transformer.h.0.attn.c_proj (results stay exact, this part is not split; plan={'transformer.h.0."
               "attn.c_proj': 'replicate'} says so explicitly and silences this)")
    assert short_warning(warning) == ("replicating transformer.h.0.attn.c_proj: add_1 at transformer.h.0: input "
                                      "dropout is whole on every rank but the op needs it split along dim 2")


def test_attention_collective_credited_to_multihead_attention(models: Path) -> None:
    """nn.MultiheadAttention: its in- and out-projection and its all-reduce form one block row."""
    model, args, _ = load_model(f"{models}:Encoder")
    sm = tpcompile.shard(model, 2, example_inputs=args)
    traced = trace(sm, args, {})
    report = plan_report(sm, traced.events, "t")
    attn = [p.name for p in report.params if p.block == "layer.self_attn"]
    assert attn == ["layer.self_attn.in_proj_weight", "layer.self_attn.in_proj_bias",
                    "layer.self_attn.out_proj.weight", "layer.self_attn.out_proj.bias"]
    assert [(c.op, c.block) for c in report.collectives] == [("all_reduce", "layer.self_attn"),
                                                            ("all_reduce", "layer")]
    with torch.no_grad():  # numerical twin
        for out in traced.outputs:
            torch.testing.assert_close(out, model(*args), atol=1e-5, rtol=1.3e-6)


def test_summary_is_the_plan_tables(capsys: pytest.CaptureFixture[str]) -> None:
    """summary() shows the plan's parameter and block tables, bytes per rank as `tpcompile plan` prints them."""
    sm = tpcompile.shard(build("gpt"), 2)
    summary = sm.summary()
    assert main(["plan", "gpt"]) == 0
    plan = capsys.readouterr().out
    tables = summary.split("\nparameters\n")[1].split("\nparameters per rank")[0]
    assert tables.strip() and tables in plan
    assert "transformer.h.0.mlp.c_fc.weight           column@0            256x64     128x64         32.0 KiB" in tables


def test_padding_of_an_mlp_hidden_size_is_shown_and_documented(capsys: pytest.CaptureFixture[str]) -> None:
    """At 3 ranks the MLP's hidden size 256 is padded to 258, as the plan says and docs/cli.md explains."""
    assert main(["plan", "mlp", "-w", "3"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert rows["layers.0.weight"][1:6] == ["column@0", "padded", "258", "(86|86|84)", "256x64"]
    assert rows["layers.0.weight"][6] == "86x64"
    docs = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text(encoding="utf-8")
    assert "an MLP hidden size" in docs
    model = build("mlp")
    sm = tpcompile.shard(model, 3)
    (x,) = model.example_inputs()
    with torch.no_grad():  # numerical twin: the padded split computes the original
        for out in tpcompile.simulate(sm, x):
            torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1.3e-6)


def test_svg_leaves_out_unused_nodes_and_keeps_the_end_of_names() -> None:
    """The picture has no edgeless box for a tied weight's second name or export's guard; its legend names them,
    reads the placement notation, and long names keep their ends."""
    import xml.etree.ElementTree as ET

    from tpcompile.report.graph_svg import render_svg
    from tpcompile.report.node_table import node_infos

    model = build("gpt")
    sm = tpcompile.shard(model, 2)
    root = ET.fromstring(render_svg(node_infos(sm.rank(0)), "rank 0"))
    ns = "{http://www.w3.org/2000/svg}"
    titles = [t.text.split(" = ")[0] for t in root.iter(f"{ns}title")]
    assert "lm_head_weight" in titles and "transformer_wte_weight" not in titles and "_guards_fn" not in titles
    texts = [t.text for t in root.iter(f"{ns}text")]
    note = next(t for t in texts if t.startswith("\u2026 marks a shortened name: hover a box for all of it; "))
    hidden = note.split("not drawn, as nothing uses them: ")[1].split(", ")
    assert {"transformer_wte_weight", "_guards_fn"} <= set(hidden) and not set(hidden) & set(titles)
    assert any(t.startswith("R: whole on every rank; S(d): split along dim d") for t in texts)
    assert "\u2026rmer_h_0_attn_c_attn_weight" in texts
    (idx,) = model.example_inputs()
    with torch.no_grad():  # numerical twin: the pictured rank graphs compute the original
        for out in tpcompile.simulate(sm, idx):
            torch.testing.assert_close(out, model(idx), atol=1e-5, rtol=1.3e-6)
