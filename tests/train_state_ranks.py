"""Rank functions of tests/test_train_state.py, run in gloo processes by tpcompile.runtime.launch."""
from __future__ import annotations

import torch

from hybrid_helpers import BATCH, batches, build, inputs, loss_fn

LR = 1e-2


def shifted(name: str) -> torch.nn.Module:
    """The tiny model with every weight moved, so that a load that restores nothing shows in the losses."""
    model = build(name)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05)
    return model


def hybrid(rank: int, run: dict) -> dict:
    """Train the GPT at run["layout"] up to run["end"] steps, resuming from run["dir"] when it holds a checkpoint.

    Saves the whole training state at run["end"] when run["save"]; returns the first step run and the losses.
    """
    import tpcompile
    import tpcompile.dcp
    dp, tp, pp = run["layout"]
    mesh = tpcompile.init_mesh(dp=dp, tp=tp, pp=pp)
    data, d, per = batches(run["end"]), mesh["dp"].get_local_rank(), BATCH // dp
    a, k = inputs("gpt", data[0][:per])
    model = shifted("gpt") if run.get("shift") else build("gpt")  # shifted: only a load gives the right losses
    hm = tpcompile.parallelize_train(model, mesh, loss_fn=loss_fn, example_inputs=a, example_kwargs=k,
                                     microbatches=pp, data_parallel=run.get("data_parallel", "fsdp"))
    opt = torch.optim.AdamW(hm.parameters(), lr=LR)
    start = tpcompile.dcp.resume(hm, run["dir"], optimizer=opt)
    losses = []
    for ids in data[start:run["end"]]:
        mine = ids[d * per:(d + 1) * per]
        opt.zero_grad()
        losses.append(hm.step(mine, target=mine).item())
        opt.step()
    if run.get("save"):
        tpcompile.dcp.save_step(hm, run["dir"], run["end"], optimizer=opt, extra={"layout": list(run["layout"])})
    return {"start": start, "losses": losses}


def rank_module(rank: int, path: str, steps: int) -> list[float]:
    """Train a tpcompile.parallelize rank module of the GPT (all ranks of the launch) for `steps` AdamW steps; save."""
    import tpcompile
    import tpcompile.dcp
    data = batches(steps)
    local = tpcompile.parallelize(build("gpt"), example_inputs=(data[0],))
    opt = torch.optim.AdamW(local.parameters(), lr=LR)
    losses = []
    for ids in data:
        opt.zero_grad()
        loss = loss_fn(local(ids), ids)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    tpcompile.dcp.save(local, path, optimizer=opt, step=steps)
    return losses


def runs(rank: int, hybrid_runs: list[dict], module_path: str, module_steps: int) -> dict:
    """The hybrid runs one after another in these processes, then the rank-module run."""
    return {"hybrid": [hybrid(rank, run) for run in hybrid_runs],
            "module": rank_module(rank, module_path, module_steps)}
