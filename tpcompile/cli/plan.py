"""`tpcompile plan MODEL`: every parameter's split, per-block bytes, collectives per forward."""
from __future__ import annotations

import argparse

from rich.console import Console

from tpcompile.cli.common import add_model_args, load, print_out, shard
from tpcompile.cli.progress import step
from tpcompile.report.plan_table import plan_report, print_plan
from tpcompile.report.trace import trace


def add_parser(sub: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    """Register the subcommand."""
    p = sub.add_parser("plan", parents=[parent], help="tables of the sharding plan, bytes per rank and collectives",
                       description="Shard MODEL and print every parameter's split, the bytes each rank holds "
                                   "per block, and the collectives one forward runs (counted in a simulated "
                                   "forward on the example inputs) with their communication bytes.")
    add_model_args(p)
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    """Print the plan tables."""
    loaded = load(ns)
    sm = shard(ns, loaded, show_warnings=False)  # the plan lists them, once, under its tables
    with step(f"running one simulated forward on {ns.world_size} ranks to count collectives"):
        events = trace(sm, loaded.args, loaded.kwargs).events
    title = f"tpcompile plan: {loaded.name} at world size {ns.world_size}" + (
        ", sequence parallel" if ns.sequence_parallel else "")
    report = plan_report(sm, events, title)

    def draw(console: Console) -> None:
        print_plan(report, console, loaded.inputs, full_warnings=ns.debug)
        if (report.replicated or report.warnings) and not ns.debug:
            console.print("(--debug shows each reason as the compiler wrote it)", highlight=False, markup=False)
    print_out(draw)
    return 0
