"""The cost model's figures for a profiled run, and the cluster fields a profile measures (`--calibrate`).

The prediction is the planner's own (tpcompile/strategy): the model captured at the run's batch and
sequence length, tpcompile's plan at the run's world size, the layout tp = world size (no data or
pipeline parallelism, one microbatch), priced on a cluster (this machine's calibration by default).
Each measured collective is priced by the same alpha-beta model (strategy/comm.py) at its op and
bytes, so a collective's prediction sits beside its measurement call for call.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from tpcompile.strategy import comm
from tpcompile.strategy.cluster import PARSERS, Cluster

__all__ = ["Prediction", "calibrated", "cluster_yaml", "predict"]

BACKWARD_ONLY = ("grad_bucket_all_reduce", "grad_piece_all_reduce", "linears_grad_all_reduce")
SPREAD = 4.0  # the largest collective must move this many times the smallest's bytes to fit a bandwidth


@dataclass
class Prediction:
    """Predicted milliseconds of one step: in all, per cost-model term, per block (compute, communication)."""

    cluster: Cluster
    world: int
    step_ms: float
    terms: dict[str, float]
    blocks: dict[str, tuple[float, float]]

    def collective_ms(self, op: str, phase: str, nbytes: float) -> float:
        """The alpha-beta time of one call of `op` whose per-rank input is `nbytes` (phase: forward | backward)."""
        bw, alpha = self.cluster.link(self.world)
        return _ring(op, phase, nbytes, self.world, bw, alpha).seconds * 1e3

    def cluster_fields(self) -> dict[str, Any]:
        """The cluster priced on, field by field."""
        return dataclasses.asdict(self.cluster)


def _ring(op: str, phase: str, nbytes: float, p: int, bw: float, alpha: float) -> comm.Cost:
    """Cost of one call: an all-reduce, all-gather (nbytes its per-rank input) or reduce-scatter; else nothing."""
    if phase == "outside" or op in ("grad_all_reduce", "scatter", "wait") or (phase == "forward" and op in BACKWARD_ONLY):
        return comm.ZERO  # these communicate in backward only (or are the wait of a started one)
    if op in ("all_gather", "all_gather_replicated"):
        return comm.all_gather(nbytes * p, p, bw, alpha)
    if op == "reduce_scatter":
        return comm.reduce_scatter(nbytes, p, bw, alpha)
    return comm.all_reduce(nbytes, p, bw, alpha)


def _batch(args: tuple, kwargs: dict) -> int:
    """The batch size: the first dim of the first tensor input."""
    for t in list(args) + list(kwargs.values()):
        if isinstance(t, torch.Tensor) and t.dim():
            return int(t.shape[0])
    return 1


def predict(model: nn.Module, args: tuple, kwargs: dict, world: int, *, training: bool,
            cluster: Cluster) -> Prediction:
    """The cost model's step of `model` at tp = `world` on `cluster`, with its terms and its blocks."""
    import warnings

    from tpcompile.errors import TPCompileWarning
    from tpcompile.strategy.cost import Layout, _blocks, estimate
    from tpcompile.strategy.profile import build_profile
    from tpcompile.strategy.tp_profile import tp_profile
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TPCompileWarning)
        profile = build_profile(model, example_inputs=args, example_kwargs=kwargs, seq_len=None)
        tpp = tp_profile(profile, world)
    batch = _batch(args, kwargs)
    lay = Layout(world, 1, 1, 1)
    est = estimate(profile, tpp, cluster, lay, batch, training)
    per = _blocks(profile, tpp, cluster, lay, batch, training)
    terms = {k: v * 1e3 for k, v in est.time.items()}
    terms["bubble"] = terms.get("bubble", 0.0) + terms.pop("imbalance", 0.0)
    blocks = {b.name: (per.compute[i] * 1e3, per.tp_s[i] * 1e3) for i, b in enumerate(profile.blocks)}
    return Prediction(cluster, world, est.step_s * 1e3, terms, blocks)


def _fit_link(report: dict[str, Any], p: int, bw: float, alpha: float) -> tuple[float, float]:
    """(latency per ring step, bandwidth) fit to the collectives' own cost (time minus waiting) by least squares;
    the bandwidth kept when the sizes do not tell it apart from the latency."""
    rows = []
    for b in report["blocks"]:
        for c in b["collectives"]:
            calls = c.get("calls") or 1.0
            unit = _ring(c["op"], c["phase"], c["bytes"], p, 1.0, 1.0)  # seconds = steps + sent at unit rates
            sent = unit.sent
            steps = unit.seconds - sent
            if steps > 0 and c["phase"] != "outside":
                rows.append((steps, sent, max(c["ms"] - c["wait_ms"], 0.0) / calls / 1e3))
    if not rows:
        return alpha, bw
    a = torch.tensor([[s, n] for s, n, _ in rows], dtype=torch.float64)
    t = torch.tensor([x for _, _, x in rows], dtype=torch.float64)
    sizes = [n for _, n, _ in rows]
    if max(sizes) >= SPREAD * min(sizes):  # sizes far enough apart to tell bandwidth from latency
        sol = torch.linalg.lstsq(a, t.unsqueeze(1)).solution.squeeze(1)
        if float(sol[0]) > 0 and float(sol[1]) > 0:
            return float(sol[0]), 1.0 / float(sol[1])
    fit = float(((t - a[:, 1] / bw) / a[:, 0]).mean())
    return max(fit, 1e-7), bw


def calibrated(report: dict[str, Any], prediction: Prediction) -> tuple[Cluster, list[str]]:
    """The prediction's cluster with the fields this profile measured replaced; and their names."""
    cl = prediction.cluster
    terms = {t["term"]: t for t in report["terms"]}
    alpha, bw = _fit_link(report, prediction.world, *cl.link(prediction.world))
    fields: dict[str, Any] = {"intra_latency": alpha, "inter_latency": alpha, "intra_bw": bw, "inter_bw": bw}
    pc = terms["compute"]["predicted_ms"]
    slower = 1.0  # how much slower the compute rates became
    if pc and terms["compute"]["measured_ms"] > 0:  # scaled alike: one figure cannot tell matmuls from memory traffic
        slower = terms["compute"]["measured_ms"] / pc
        eff = min(1.0, cl.efficiency / slower)
        fields.update(efficiency=eff, flops=cl.matmul_rate / slower / eff, memory_bw=cl.memory_bw / slower,
                      op_overhead=cl.op_overhead * slower)
    po = terms["optimizer"]["predicted_ms"]
    if po and terms["optimizer"]["measured_ms"] > 0:  # the optimizer's time also scales with the rates just set
        r = terms["optimizer"]["measured_ms"] / po / slower
        fields.update(optimizer_bytes=cl.optimizer_bytes * r, optimizer_ops=cl.optimizer_ops * r)
    if report.get("train"):
        fields["step_overhead"] = max(0.0, terms["overhead"]["measured_ms"] / 1e3 - cl.microbatch_overhead)
    return dataclasses.replace(cl, **fields), sorted(fields)


def cluster_yaml(cluster: Cluster, measured: list[str], source: str) -> str:
    """A cluster file for `tpcompile strategy --cluster`: every field, the measured ones said so."""
    lines = [f"# written by {source} on {time.strftime('%Y-%m-%d %H:%M:%S')}",
             f"# measured by the profile: {', '.join(measured)}; the rest as the prediction's cluster",
             "# (rates in bytes/s and FLOP/s, latencies and overheads in seconds, memory in bytes)"]
    for f in dataclasses.fields(cluster):
        if f.name not in PARSERS:
            continue
        value = getattr(cluster, f.name)
        text = f"{value:.6e}" if isinstance(value, float) else (f"'{value}'" if isinstance(value, str) else str(value))
        lines.append(f"{f.name}: {text}" + ("  # measured" if f.name in measured else ""))
    return "\n".join(lines) + "\n"


def default_cluster(world: int, backend: str, path: Optional[str]) -> tuple[Cluster, str]:
    """The cluster to predict on: a --cluster file, else this machine's calibration (CPU ranks on gloo)."""
    from tpcompile.strategy.cluster import load_cluster
    if path:
        return dataclasses.replace(load_cluster(path), gpus=world, gpus_per_node=world), f"cluster file {path}"
    from tpcompile.strategy.calibrate import cache_path, this_machine
    if backend != "gloo":
        return Cluster(gpus=world, gpus_per_node=world), "the default cluster (an H100 node); pass --cluster FILE"
    return this_machine(world), f"this machine's calibration ({cache_path()})"
