"""`tpcompile verify MODEL`: simulate every rank on random inputs and compare with the original model."""
from __future__ import annotations

import argparse
import math

import torch

import tpcompile
from tpcompile.cli.common import add_model_args, leaves, load, shard, stdout_console
from tpcompile.cli.inputs import inputs_from_specs, parse_input_spec, random_like
from tpcompile.cli.progress import step
from tpcompile.errors import TPCompileError

DEFAULT_TOL = 1e-5
VERIFY_SEED = 1  # not the capture seed: the graphs must hold for inputs they were not captured with


def add_parser(sub: argparse._SubParsersAction, parent: argparse.ArgumentParser, name: str = "verify",
               alias_of: str = "") -> None:
    """Register the subcommand (and `check`, the same command under its older name)."""
    p = sub.add_parser(name, parents=[parent],
                       help=f"same as {alias_of}" if alias_of else
                       "simulate every rank on random inputs and compare with the original model",
                       description="Shard MODEL, draw random inputs of the --inputs shapes (or the example "
                                   "inputs' shapes), run all ranks in the in-process simulator and the original "
                                   "model, print the largest absolute difference per output, exit 1 when one "
                                   "exceeds --tol.")
    add_model_args(p)
    p.add_argument("--tol", type=float, default=DEFAULT_TOL, help=f"largest allowed |difference| ({DEFAULT_TOL:g})")
    p.add_argument("--seed", type=int, default=VERIFY_SEED, help="seed of the random inputs")
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    """Compare every rank with the original; 0 when all outputs agree within --tol, else 1."""
    loaded = load(ns)
    if not loaded.args and not loaded.kwargs:
        raise TPCompileError(f"verify needs inputs and {ns.model} has no example_inputs(); pass --inputs "
                             "SHAPE:DTYPE per positional input, e.g. --inputs 2x16:long")
    sm = shard(ns, loaded)
    if ns.inputs:
        specs = [parse_input_spec(s) for s in ns.inputs]
        args, kwargs = inputs_from_specs(specs, loaded.model, loaded.args, loaded.kwargs, ns.seed)
    else:
        args, kwargs = random_like(loaded.args, loaded.kwargs, ns.seed)
    for r in range(ns.world_size):
        with step(f"building rank {r} of {ns.world_size}"):
            sm.rank(r)
    with torch.no_grad():
        with step("running the original model"):
            expected = leaves(loaded.model(*args, **kwargs))
        with step(f"simulating {ns.world_size} ranks"):
            outputs = [leaves(o) for o in tpcompile.simulate(sm, *args, **kwargs)]
    console = stdout_console()
    console.print(f"verify {loaded.name} at world size {ns.world_size} on random inputs "
                  f"({loaded.inputs}, seed {ns.seed})", highlight=False, markup=False, soft_wrap=True)
    worst = 0.0
    for k, (path, ref) in enumerate(expected):
        per_rank = [_diff(ref, out[k][1] if k < len(out) else None) for out in outputs]
        worst = max([worst, *per_rank])
        ranks = ", ".join(f"rank {r} {d:.2e}" for r, d in enumerate(per_rank))
        shape = "x".join(map(str, ref.shape)) or "scalar"
        console.print(f"{path} ({shape}): max |diff| {max(per_rank, default=0.0):.2e} ({ranks})",
                      highlight=False, markup=False, soft_wrap=True)
    if any(len(o) != len(expected) for o in outputs):
        worst = math.inf
        console.print("output structure differs from the original's", highlight=False, markup=False)
    ok = worst <= ns.tol
    verdict = "OK" if ok else "FAIL"
    console.print(f"{verdict}: max |diff| {worst:.2e} {'<=' if ok else '>'} {ns.tol:.0e} over "
                  f"{ns.world_size} ranks and {len(expected)} outputs", highlight=False, markup=False, soft_wrap=True)
    return 0 if ok else 1


def _diff(ref: torch.Tensor, got: torch.Tensor | None) -> float:
    """Largest absolute difference of two tensors; infinite when missing or shaped differently."""
    if got is None or got.shape != ref.shape:
        return math.inf
    if not ref.numel():
        return 0.0
    return float((ref.detach().double() - got.detach().double()).abs().max())
