"""`tpcompile verify MODEL [--train]`: simulate every rank on random inputs and compare with the original model
(with --train also one backward: the loss and every parameter's gradient)."""
from __future__ import annotations

import argparse
from typing import Any

import torch

import tpcompile
from tpcompile.cli.common import Loaded, add_model_args, load, shard, stdout_console, tolerance
from tpcompile.cli.compare import OutputCheck, check_outputs
from tpcompile.cli.inputs import inputs_from_specs, parse_input_spec, random_like
from tpcompile.cli.progress import step

VERIFY_SEED = 1  # not the capture seed: the graphs must hold for inputs they were not captured with


def add_parser(sub: argparse._SubParsersAction, parent: argparse.ArgumentParser, name: str = "verify",
               alias_of: str = "") -> None:
    """Register the subcommand (and `check`, the same command under its older name)."""
    p = sub.add_parser(name, parents=[parent],
                       help=f"same as {alias_of}" if alias_of else
                       "simulate every rank on random inputs and compare with the original model",
                       description="Shard MODEL, draw random inputs of the --inputs shapes (or the example "
                                   "inputs' shapes), run all ranks in the in-process simulator and the original "
                                   "model, print the largest absolute and relative difference per output, exit 1 "
                                   "when one exceeds atol + rtol * max|output| (torch.testing.assert_close's "
                                   "defaults for the output's dtype: 1e-5 and 1.3e-6 for float32). With --train, "
                                   "also one backward of the loss sum(output * a random tensor): the loss and every "
                                   "parameter's gradient on every rank against the original's (within atol + rtol * "
                                   "max|gradient|), exit 1 naming the parameter and rank of the worst mismatch.")
    add_model_args(p)
    p.add_argument("--atol", type=tolerance, default=None, help="absolute tolerance (default: by dtype, 1e-5 for float32)")
    p.add_argument("--rtol", type=tolerance, default=None,
                   help="tolerance relative to the largest |value| of the output (default: by dtype, 1.3e-6 for "
                        "float32)")
    p.add_argument("--tol", dest="atol", type=tolerance, help=argparse.SUPPRESS)  # older spelling of --atol
    p.add_argument("--seed", type=int, default=VERIFY_SEED, help="seed of the random inputs (and, with --train, of "
                                                                 "the loss's random weights)")
    p.add_argument("--train", action="store_true",
                   help="also run one backward and compare every parameter's gradient on every rank with the "
                        "original's (tpcompile.check_gradients)")
    p.set_defaults(func=run)


def describe(check: OutputCheck) -> str:
    """'logits (2x16x256): max |diff| 1.8e-07, relative 1.6e-07, allowed 1.1e-05 (rank 0 1.79e-07, ...)'."""
    shape = "x".join(map(str, check.shape)) or "scalar"
    split = f"; each rank holds a slice, {check.split}, compared with that slice of the original" if check.split else ""
    ranks = ", ".join(f"rank {r} {d:.2e}" for r, d in enumerate(check.diffs))
    return (f"{check.path} ({shape}{split}): max |diff| {check.worst:.2e}, relative {check.relative:.1e}, "
            f"allowed {check.allowed:.1e} ({ranks})")


def verdict(checks: list[OutputCheck], world_size: int) -> tuple[bool, str]:
    """Whether every output is within its tolerance, and the numbers of the one nearest to (or furthest past) it."""
    ok = all(c.ok for c in checks)
    if not checks:
        return ok, f"no tensor outputs to compare over {world_size} ranks"
    worst = max(checks, key=lambda c: c.worst / c.allowed if c.allowed else (0.0 if c.worst == 0 else float("inf")))
    return ok, (f"max |diff| {worst.worst:.2e} {'<=' if worst.ok else '>'} {worst.allowed:.2e} = atol {worst.atol:g} "
                f"+ rtol {worst.rtol:g} x max |output| {worst.scale:.3g} ({worst.path}) over {world_size} ranks and "
                f"{len(checks)} outputs")


def run(ns: argparse.Namespace) -> int:
    """Compare every rank with the original; 0 when all outputs agree within tolerance, else 1."""
    loaded = load(ns)
    sm = shard(ns, loaded)
    if ns.inputs:
        specs = [parse_input_spec(s) for s in ns.inputs]
        args, kwargs = inputs_from_specs(specs, loaded.model, loaded.args, loaded.kwargs, ns.seed)
    else:
        args, kwargs = random_like(loaded.args, loaded.kwargs, ns.seed)
    for r in range(ns.world_size):
        with step(f"building rank {r} of {ns.world_size}"):
            sm.rank(r)
    if ns.train:
        return run_train(ns, loaded, sm, args, kwargs)
    with torch.no_grad():
        with step("running the original model"):
            expected = loaded.model(*args, **kwargs)
        with step(f"simulating {ns.world_size} ranks"):
            outputs = tpcompile.simulate(sm, *args, **kwargs)
    checks = check_outputs(expected, outputs, sm, atol=ns.atol, rtol=ns.rtol)
    console = stdout_console()
    say = lambda text: console.print(text, highlight=False, markup=False, soft_wrap=True)  # noqa: E731
    say(f"verify {loaded.name} at world size {ns.world_size} on random inputs ({loaded.inputs}, seed {ns.seed})")
    for check in checks:
        say(describe(check))
    ok, numbers = verdict(checks, ns.world_size)
    say(f"{'OK' if ok else 'FAIL'}: {numbers}")
    return 0 if ok else 1


def run_train(ns: argparse.Namespace, loaded: Loaded, sm: Any, args: tuple, kwargs: dict) -> int:
    """One forward and backward of every rank and of the original; 0 when the loss and every gradient agree, else 1."""
    with step(f"simulating {ns.world_size} ranks and the original model, forward and backward"):
        report = tpcompile.check_gradients(loaded.model, sm, *args, seed=ns.seed, atol=ns.atol, rtol=ns.rtol,
                                           **kwargs)
    console = stdout_console()
    say = lambda text: console.print(text, highlight=False, markup=False, soft_wrap=True)  # noqa: E731
    say(f"verify --train {loaded.name} at world size {ns.world_size} on random inputs ({loaded.inputs}, seed "
        f"{ns.seed}): one forward and backward of the loss sum(output * a random tensor of seed {ns.seed})")
    for line in report.lines():
        say(line)
    return 0 if report.ok else 1
