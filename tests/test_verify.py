"""The verifier: deliberately corrupted rank graphs and slices are caught, naming the node or parameter."""
from __future__ import annotations

import copy
import time

import pytest
import torch

import tpcompile
from tpcompile.models import build
from tpcompile.ops.schedule import graph_schedule as collective_signature
from tpcompile.passes.decisions import freeze
from tpcompile.passes.pass_context import PassContext
from tpcompile.passes.verify_plan import check_tiling, verify_pass
from tpcompile.passes.verify_ranks import verify_rank
from tpcompile.placement import ParamSlice, pad_cuts, piece_cut


@pytest.fixture(scope="module")
def gpt_sharded() -> tuple:
    """The bundled GPT at world size 2, its ranks built, and the original's logits on a fixed batch."""
    torch.manual_seed(0)
    model = build("gpt").eval()
    sm = tpcompile.shard(model, 2)
    idx = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        ref = model(idx)
        outs = tpcompile.simulate(sm, idx)
    return sm, ref, outs


def _param_shapes(sm: tpcompile.ShardedModel) -> dict:
    return {name: pp.local_shape for name, pp in sm.plan.parameters.items()}


def test_clean_ranks_pass_and_equal_the_original(gpt_sharded: tuple) -> None:
    """Uncorrupted ranks verify, and (the numerical twin) each equals the original model."""
    sm, ref, outs = gpt_sharded
    reference = collective_signature(sm.rank(0))
    for r in range(2):
        verify_rank(sm.rank(r), reference, r, _param_shapes(sm))
    assert [call.op for call, _ in reference].count("all_reduce") == 2 * 2 + 1  # 2 per block, 1 embedding
    for out in outs:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_collective_shapes_are_expressions(gpt_sharded: tuple) -> None:
    """Each collective carries its input's per-rank shape with the batch and length symbolic."""
    sm, _, _ = gpt_sharded
    shapes = [call.shape for call, _ in collective_signature(sm.rank(0))]
    assert all(s is not None for s in shapes)
    assert shapes[0][-1] == "64" and not shapes[0][0].isdigit() and not shapes[0][1].isdigit()
    assert shapes[-1][-1] == "128"  # the vocabulary-split logits gathered at the end: 256 / 2


def test_collective_removed_on_one_rank_is_caught(gpt_sharded: tuple) -> None:
    """Rank 1 without its second all_reduce: the verifier names collective #k and both nodes."""
    sm, _, _ = gpt_sharded
    reference = collective_signature(sm.rank(0))
    gm = copy.deepcopy(sm.rank(1))
    reduces = (torch.ops.tpcompile.all_reduce.default, torch.ops.tpcompile.all_reduce.inplace)  # comm=False, None
    victim = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in reduces][1]
    victim.replace_all_uses_with(victim.args[0])
    gm.graph.erase_node(victim)
    gm.recompile()
    k = [node.name for _, node in reference].index(victim.name)
    with pytest.raises(tpcompile.TPCompileError, match=rf"collective #{k} differs between ranks: rank 1 issues "
                                                      rf".*rank 0 issues tpcompile::all_reduce.*{victim.name}"):
        verify_rank(gm, reference, 1, _param_shapes(sm))


def test_collective_with_other_dim_is_caught(gpt_sharded: tuple) -> None:
    """A gather along another dim on one rank differs from rank 0's and is caught before running."""
    sm, _, _ = gpt_sharded
    reference = collective_signature(sm.rank(0))
    gm = copy.deepcopy(sm.rank(1))
    gather = next(n for n in gm.graph.nodes if n.op == "call_function"
                  and n.target is torch.ops.tpcompile.all_gather_replicated.default)
    gather.args = (gather.args[0], 1, gather.args[2])
    with pytest.raises(tpcompile.TPCompileError, match=r"rank 1 issues tpcompile::all_gather_replicated\(1, "):
        verify_rank(gm, reference, 1, _param_shapes(sm))


def test_extra_collective_at_the_end_is_caught(gpt_sharded: tuple) -> None:
    """One more all_reduce on rank 1 than on rank 0: rank 0 'issues nothing' at that step."""
    sm, _, _ = gpt_sharded
    reference = collective_signature(sm.rank(0))
    gm = copy.deepcopy(sm.rank(1))
    out = gm.graph.output_node()
    with gm.graph.inserting_before(out):
        extra = gm.graph.call_function(torch.ops.tpcompile.all_reduce.default, (out.args[0][0], "default"))
    out.args = ((extra,),) + tuple(out.args[1:])
    with pytest.raises(tpcompile.TPCompileError, match=rf"collective #{len(reference)} differs.*rank 0 issues nothing"):
        verify_rank(gm, reference, 1, _param_shapes(sm))


def test_wrongly_sliced_parameter_on_one_rank_is_caught(gpt_sharded: tuple) -> None:
    """A rank holding a parameter slice of the wrong size is named with both shapes."""
    sm, _, _ = gpt_sharded
    gm = copy.deepcopy(sm.rank(1))
    name = "transformer.h.0.mlp.c_fc.weight"
    gm.get_submodule("transformer.h.0.mlp.c_fc").weight = torch.nn.Parameter(torch.zeros(100, 64))
    with pytest.raises(tpcompile.TPCompileError, match=rf"rank 1 holds parameter {name} as shape \[100, 64\], the plan "
                                                      rf"says \[128, 64\]"):
        verify_rank(gm, collective_signature(sm.rank(0)), 1, _param_shapes(sm))


def test_malformed_graph_is_caught(gpt_sharded: tuple) -> None:
    """A graph using a value before it is defined fails lint, reported as a TPCompileError."""
    sm, _, _ = gpt_sharded
    gm = copy.deepcopy(sm.rank(1))
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    nodes[3].prepend(nodes[5])  # nodes[5] now runs before its inputs
    with pytest.raises(tpcompile.TPCompileError, match=r"rank 1's graph is malformed: Argument '\w+' of Node '\w+' was used before .*report"):
        verify_rank(gm, collective_signature(sm.rank(0)), 1, _param_shapes(sm))


@pytest.mark.parametrize("shape, sl, why", [
    ((10, 4), ParamSlice(0, segments=(6, 6)), r"split size 10 \(segments \(6, 6\)\) does not match"),
    ((10, 4), ParamSlice(0, cuts=pad_cuts(8, 2)), r"split size 8 .* does not match its dim 0 of size 10"),
    ((10, 4), ParamSlice(0, cuts=((0, 4, 12),)), r"cuts \(\(0, 4, 12\),\) of its whole dim 0 are not one even piece"),
    ((10, 4), ParamSlice(2), r"split on dim 2, which it does not have"),
    ((10, 6), piece_cut(1, 6, 3), r"cuts \(\(0, 2, 4, 6\),\) do not fit segments \(6,\) of dim 1 \(size 6\) at world size 2"),
    ((9, 4), ParamSlice(0), r"dim 0 of size 9 .* cannot be cut into 2 equal pieces"),
])
def test_out_of_bounds_or_untiled_slices_are_caught(shape: tuple, sl: ParamSlice, why: str) -> None:
    """Slices that overrun, miss or cannot tile a parameter raise, naming it and the way out."""
    with pytest.raises(tpcompile.TPCompileError, match=rf"parameter layer\.w\b.*{why}"):
        check_tiling("layer.w", shape, sl, 2)
    with pytest.raises(tpcompile.TPCompileError, match=r"plan=\{'layer': 'replicate'\}"):
        check_tiling("layer.w", shape, sl, 2)


def test_verify_pass_checks_every_split_parameter() -> None:
    """The pass run by shard() rejects a corrupted slice table (it is not only the helper)."""
    ctx = PassContext(2)
    ctx.tensors = {"fc.weight": torch.zeros(8, 4), "fc.bias": torch.zeros(8)}
    ctx.param_slices = {"fc.weight": ParamSlice(0), "fc.bias": ParamSlice(0, cuts=pad_cuts(6, 2))}
    gm = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    with pytest.raises(tpcompile.TPCompileError, match=r"parameter fc\.bias: split size 6"):
        verify_pass(gm, freeze(gm, ctx))
    ctx.param_slices["fc.bias"] = ParamSlice(0)
    assert verify_pass(gm, freeze(gm, ctx)) is gm


def test_verify_is_cheap(gpt_sharded: tuple) -> None:
    """Verifying a rank of the bundled GPT is a walk over its graph: well under 50 ms here."""
    sm, _, _ = gpt_sharded
    reference, shapes = collective_signature(sm.rank(0)), _param_shapes(sm)
    start = time.perf_counter()
    for _ in range(10):
        verify_rank(sm.rank(1), reference, 1, shapes)
    per_rank = (time.perf_counter() - start) / 10
    print(f"verify_rank, bundled GPT rank: {per_rank * 1e3:.2f} ms")
    assert per_rank < 0.05


def test_a_process_building_one_rank_compares_with_rank_0() -> None:
    """Under torchrun a process builds only its rank; the reference is still rank 0's schedule."""
    sm = tpcompile.shard(build("mlp"), 2)
    sm.rank(1)
    assert 0 not in sm._ranks and sm._reference  # rank 0's graph was emitted without its weights
    assert [call for call, _ in sm._reference] == [call for call, _ in collective_signature(sm.rank(0))]
    x = torch.randn(3, 64)
    with torch.no_grad():
        torch.testing.assert_close(tpcompile.simulate(sm, x)[1], build("mlp")(x), atol=1e-5, rtol=1e-5)
