"""The report builders behind the command line: input specs, plan rows, node tables, layout, SVG and graph diffs."""
from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest
import torch
from torch import nn

import tpcompile
from tpcompile.cli.common import config_value, parse_config
from tpcompile.cli.inputs import inputs_from_specs, parse_input_spec, random_like
from tpcompile.errors import TPCompileError
from tpcompile.models import build
from tpcompile.report.graph_diff import diff_text, graph_diff
from tpcompile.report.graph_layout import layers_of, layout
from tpcompile.report.graph_svg import STYLE, render_svg
from tpcompile.report.node_table import node_infos
from tpcompile.report.plan_table import plan_report, ring_bytes
from tpcompile.report.trace import trace

SVG = "{http://www.w3.org/2000/svg}"


class Heads(nn.Module):
    """A projection viewed as 4 heads of 8: the head count is a literal the rewrite must halve."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 32)
        self.out = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.qkv(x).view(b, t, 4, 8).relu()
        return self.out(h.reshape(b, t, 32))


@pytest.fixture(scope="module")
def heads() -> tuple:
    """Heads sharded over 2 ranks, its input and its output."""
    torch.manual_seed(0)
    model = Heads().eval()
    x = torch.randn(2, 3, 16)
    return model, x, tpcompile.shard(model, 2, example_inputs=(x,))


@pytest.mark.parametrize(("text", "shape", "dtype", "high"), [
    ("2x16:long", (2, 16), torch.long, None), ("4x64", (4, 64), torch.float32, None),
    ("8:bf16", (8,), torch.bfloat16, None), ("2x3:int:100", (2, 3), torch.int32, 100),
    ("1x2:BOOL", (1, 2), torch.bool, None),
])
def test_input_specs(text: str, shape: tuple, dtype: torch.dtype, high: int | None) -> None:
    """SHAPE[:DTYPE[:HIGH]] parses to its shape, dtype and integer bound."""
    spec = parse_input_spec(text)
    assert (spec.shape, spec.dtype, spec.high) == (shape, dtype, high)


@pytest.mark.parametrize("text", ["", "2x", "x2", "2x0", "2x3:float:9", "2x3:long:0", "2x3:cplx", "two"])
def test_bad_input_specs(text: str) -> None:
    """Malformed specs, zero sizes, bounds on floats and unknown dtypes are TPCompileErrors naming the spec."""
    with pytest.raises(TPCompileError, match="--inputs"):
        parse_input_spec(text)


def test_integer_inputs_stay_in_the_vocabulary() -> None:
    """Random ids for an embedding model are below its vocabulary; an explicit bound wins."""
    model = build("gpt")
    (ids,), _ = inputs_from_specs([parse_input_spec("64x64:long")], model, (), {}, seed=0)
    assert ids.shape == (64, 64) and 0 <= int(ids.min()) and int(ids.max()) < 256 and int(ids.max()) > 128
    (ids,), _ = inputs_from_specs([parse_input_spec("64x64:long:7")], model, (), {}, seed=0)
    assert int(ids.max()) == 6
    (x,), kw = random_like((torch.full((3, 4), 5),), {"use_cache": False}, seed=0)
    assert torch.equal(x, torch.full((3, 4), 5)) and kw == {"use_cache": False}  # a constant stays constant


def test_config_values() -> None:
    """--config values become ints, floats, bools, None, tuples or strings."""
    assert parse_config(["n_layer=1", "dropout=0.1", "bias=false", "dims=8,16,8", "attention=manual", "x=none"]) == {
        "n_layer": 1, "dropout": 0.1, "bias": False, "dims": (8, 16, 8), "attention": "manual", "x": None}
    assert config_value("1e-5") == 1e-5
    with pytest.raises(TPCompileError, match="key=value"):
        parse_config(["n_layer"])


def test_ring_bytes() -> None:
    """Ring estimates: all-reduce 2(p-1)/p N, all-gather (p-1) N, reduce-scatter (p-1)/p N, none at p=1."""
    assert ring_bytes("all_reduce", 1000, 4) == 1500
    assert ring_bytes("all_gather_replicated", 1000, 4) == 3000
    assert ring_bytes("reduce_scatter", 1000, 4) == 750
    assert ring_bytes("all_reduce", 1000, 1) == 0


def test_plan_report_counts_executed_collectives() -> None:
    """The plan's collectives are the ones a simulated forward ran, attributed to their blocks."""
    model = build("gpt")
    (idx,) = model.example_inputs()
    sm = tpcompile.shard(model, 2, example_inputs=(idx,))
    traced = trace(sm, (idx,), {})
    report = plan_report(sm, traced.events, "t")
    blocks = [c.block for c in report.collectives if c.op == "all_reduce"]
    assert blocks == ["transformer", "transformer.h.0.attn", "transformer.h.0.mlp", "transformer.h.1.attn",
                      "transformer.h.1.mlp"]
    assert [c.nbytes for c in report.collectives] == [2 * 16 * 64 * 4] * 5 + [2 * 16 * 128 * 4]
    assert report.backward_only == {"grad_all_reduce": 5}
    static = [op for op, _ in sm.collectives()]
    assert static == [c.op for c in report.collectives]
    with torch.no_grad():  # numerical twin: the traced ranks computed the model's output
        ref = model(idx)
    for out in traced.outputs:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_node_infos_and_shapes(heads: tuple) -> None:
    """Node facts carry the traced local shapes and the placement; collectives and partial sums are marked."""
    model, x, sm = heads
    traced = trace(sm, (x,), {})
    infos = {i.name: i for i in node_infos(sm.rank(0), traced.rank_shapes[0])}
    assert infos["view"].shape == "2x3x2x8 float32" and infos["view"].kind == "shard"
    assert infos["qkv_weight"].shape == "16x16 float32" and infos["qkv_weight"].kind == "param"
    reduce = next(i for i in infos.values() if i.kind == "collective" and "all_reduce." in i.target
                  and not i.target.startswith("tpcompile.grad"))
    assert infos[reduce.inputs[0]].kind == "partial"
    assert traced.captured_shapes["view"] == "2x3x4x8 float32"
    torch.testing.assert_close(traced.outputs[1], model(x), atol=1e-5, rtol=0)


def test_layout_rows_do_not_overlap(heads: tuple) -> None:
    """Every node sits below its computed inputs, parameters one row above their user, no two boxes overlap."""
    _, _, sm = heads
    infos = node_infos(sm.rank(0))
    layer = layers_of(infos)
    kinds = {i.name: i.kind for i in infos}
    for i in infos:
        for n in i.inputs:
            assert layer[n] < layer[i.name], (n, i.name)
            if kinds[n] == "param":
                assert layer[n] == layer[i.name] - 1
    boxes = layout(infos, box_w=100, box_h=30)
    for a in boxes:
        for b in boxes:
            if a is not b and a.y == b.y:
                assert abs(a.x - b.x) >= 100, (a.info.name, b.info.name)


def test_svg_marks_collectives_and_placements(heads: tuple) -> None:
    """The SVG parses as XML; collectives are hexagons in the collective colour, sharded nodes in theirs."""
    _, _, sm = heads
    infos = node_infos(sm.rank(0))
    root = ET.fromstring(render_svg(infos, "Heads rank 0"))
    polygons = list(root.iter(f"{SVG}polygon"))
    assert len(polygons) == sum(i.kind == "collective" for i in infos) > 0
    assert {p.get("fill") for p in polygons} == {STYLE["collective"][0]}
    fills = [r.get("fill") for r in root.iter(f"{SVG}rect")]
    assert fills.count(STYLE["shard"][0]) >= sum(i.kind == "shard" for i in infos) > 0
    tips = [t.text for t in root.iter(f"{SVG}title")]
    assert any(t.startswith("view = aten.view.default  [S(2)]") for t in tips)


def test_graph_diff_sections(heads: tuple) -> None:
    """The diff finds the halved head count, the sliced weights, the all-reduce and the replaced row matmul."""
    model, x, sm = heads
    d = graph_diff(sm.captured, sm.rank(0), 0, 2)
    changes = {row[0]: row[2] for row in d.literals}
    sizes = "sym_size_int_2, sym_size_int_3"
    assert changes == {"view": f"arg 1: [{sizes}, 4, 8] -> [{sizes}, 2, 8]",
                       "reshape": f"arg 1: [{sizes}, 32] -> [{sizes}, 16]"}
    assert [r[0] for r in d.sliced] == ["qkv.weight", "qkv.bias", "out.weight"]
    assert [r[1] for r in d.sliced] == ["[32, 16] -> [16, 16]", "[32] -> [16]", "[16, 32] -> [16, 16]"]
    assert any(r[1].startswith("all_reduce(") for r in d.collectives)
    assert [r[1] for r in d.removed] == ["aten.linear.default"]
    text = diff_text(sm, "Heads", [0, 1])
    assert text.count("## parameters sliced (old shape -> new shape): 3") == 2
    with torch.no_grad():
        for out in tpcompile.simulate(sm, x):
            torch.testing.assert_close(out, model(x), atol=1e-5, rtol=0)
