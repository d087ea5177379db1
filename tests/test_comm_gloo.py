"""The communication passes on real gloo work handles (not the simulator): in-place and asynchronous
all-reduces and the fused linears give the synchronous graph's outputs and gradients in training, and
under no_grad they run below autograd (nothing recorded) with the same outputs."""
from __future__ import annotations

import warnings

import pytest
import torch

import tpcompile
from tpcompile.models.gpt import GPT, GPTConfig
from tpcompile.runtime.launch import launch

OPS = {"start": torch.ops.tpcompile.all_reduce.start, "inplace": torch.ops.tpcompile.all_reduce.inplace,
       "fused": torch.ops.tpcompile.linears_grad_all_reduce.default}


def seeded_gpt(n_layer: int) -> tuple[GPT, torch.Tensor]:
    """The bundled GPT with seed-0 weights (the caller's RNG untouched) in training mode, and (2, 16) token ids."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=n_layer)).train()
    return model, torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))


def _rank(rank: int) -> dict:
    """Shard a 2-block GPT at ws 2 with and without the passes; train one step and run one no_grad forward."""
    torch.set_num_threads(1)
    model, ids = seeded_gpt(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tpcompile.TPCompileWarning)
        graphs = {"sync": tpcompile.shard(model, 2, example_inputs=(ids,), comm=False).rank(rank),
                  "inplace": tpcompile.shard(model, 2, example_inputs=(ids,), comm=True).rank(rank),
                  "async": tpcompile.shard(model, 2, example_inputs=(ids,),
                                           comm=tpcompile.CommOptions(asynchronous=True)).rank(rank)}
    res: dict = {"ops": {k: {op: sum(n.target is OPS[op] for n in gm.graph.nodes) for op in OPS}
                         for k, gm in graphs.items()}}
    for k, gm in graphs.items():
        out = gm(ids)
        out.float().pow(2).mean().backward()
        res[k] = (out.detach(), {n: p.grad.clone() for n, p in gm.named_parameters()})
        with torch.no_grad():
            res[k + " no_grad"] = gm(ids)
        res[k + " no_grad history"] = res[k + " no_grad"].requires_grad or res[k + " no_grad"].grad_fn is not None
    return res


@pytest.mark.gloo
def test_comm_passes_on_gloo_equal_the_synchronous_graph() -> None:
    for r, res in enumerate(launch(2, _rank, timeout=300)):
        assert res["ops"]["sync"] == {"start": 0, "inplace": 0, "fused": 0}
        assert res["ops"]["inplace"]["inplace"] >= 5 and res["ops"]["inplace"]["start"] == 0
        assert res["ops"]["async"]["start"] >= 5 and res["ops"]["async"]["fused"] >= 3
        ref_out, ref_grads = res["sync"]
        for k in ("inplace", "async"):
            out, grads = res[k]
            assert float((out - ref_out).abs().max()) <= 1e-6, f"rank {r} {k}: output"
            assert sorted(grads) == sorted(ref_grads) and len(grads) > 10
            worst = max((float((grads[n] - g).abs().max()), n) for n, g in ref_grads.items())
            assert worst[0] <= 1e-6, f"rank {r} {k}: gradient {worst}"
            assert torch.equal(res[k + " no_grad"], res["sync no_grad"]), f"rank {r} {k}: no_grad output"
            assert torch.allclose(res[k + " no_grad"], ref_out, atol=1e-6)
            assert not res[k + " no_grad history"]
