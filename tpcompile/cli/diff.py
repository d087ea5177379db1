"""`tpcompile diff MODEL --rank R`: what sharding changed from the captured graph to rank R's graph."""
from __future__ import annotations

import argparse
import sys

from tpcompile.cli.common import add_model_args, load, shard
from tpcompile.cli.progress import step
from tpcompile.errors import TPCompileError
from tpcompile.report.graph_diff import diff_text, diff_title


def add_parser(sub: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    """Register the subcommand."""
    p = sub.add_parser("diff", parents=[parent], help="what changed from the captured graph to a rank's graph",
                       description="Print the collectives added, shape literals changed, parameters sliced and "
                                   "nodes removed from the captured graph to rank R's graph, then a unified "
                                   "diff of the generated code.")
    add_model_args(p)
    p.add_argument("--rank", "-r", type=int, default=0, help="the rank to compare (default 0)")
    p.set_defaults(func=run)


def check_rank(rank: int, world_size: int) -> None:
    """A rank outside 0..world_size-1 is a user error."""
    if not 0 <= rank < world_size:
        raise TPCompileError(f"--rank {rank} is out of range for world size {world_size} "
                             f"(valid ranks are 0..{world_size - 1})")


def run(ns: argparse.Namespace) -> int:
    """Print the diff of one rank."""
    check_rank(ns.rank, ns.world_size)
    loaded = load(ns)
    sm = shard(ns, loaded)
    with step(f"building rank {ns.rank}"):
        text = diff_text(sm, diff_title(type(loaded.model).__name__, ns.model,
                                        sequence_parallel=ns.sequence_parallel), [ns.rank])
    sys.stdout.write(text)
    return 0
