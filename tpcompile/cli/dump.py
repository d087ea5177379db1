"""`tpcompile dump MODEL --out DIR`: per rank its code, a node table and a picture, and the same for the original."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from tpcompile.cli.common import add_model_args, load, shard
from tpcompile.cli.diff import check_rank
from tpcompile.cli.progress import step
from tpcompile.errors import TPCompileError
from tpcompile.report.graph_dot import render_dot
from tpcompile.report.graph_svg import render_svg
from tpcompile.report.node_table import legend, node_infos, node_table
from tpcompile.report.trace import trace


def add_parser(sub: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    """Register the subcommand."""
    p = sub.add_parser("dump", parents=[parent], help="write each rank's code, node table and graph picture",
                       description="With --out DIR: write DIR/original/ and DIR/rank<R>/, each holding code.py "
                                   "(the GraphModule's code), nodes.txt (name, op, target, placement, shape, "
                                   "module per node; shapes from one simulated forward on the example inputs), "
                                   "graph.svg and graph.dot. Without --out: print each rank's code.")
    add_model_args(p)
    p.add_argument("--rank", "-r", type=int, default=None, help="only this rank (default: every rank)")
    p.add_argument("--out", "-o", default=None, metavar="DIR", help="folder to write the files into")
    p.set_defaults(func=run)


def _write(folder: Path, gm: object, shapes: dict[str, str], title: str, placement: Any = None) -> list[Path]:
    """code.py, nodes.txt, graph.svg and graph.dot of one graph (placed by `placement`: node_infos)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TPCompileError(f"cannot create folder {folder}: {exc.strerror or exc}; choose another --out") from exc
    infos = node_infos(gm, shapes, placement)
    files = {
        "code.py": gm.code.strip() + "\n",
        "nodes.txt": f"# {title}: {len(infos)} nodes ({legend(infos)})\n" + node_table(infos),
        "graph.svg": render_svg(infos, f"{title} ({len(infos)} nodes)"),
        "graph.dot": render_dot(infos, title),
    }
    for name, text in files.items():
        try:
            (folder / name).write_text(text, encoding="utf-8")
        except OSError as exc:
            raise TPCompileError(f"cannot write {folder / name}: {exc.strerror or exc}; choose another --out") from exc
    return [folder / name for name in files]


def run(ns: argparse.Namespace) -> int:
    """Write the files, or print the code when no --out is given."""
    ranks = list(range(ns.world_size)) if ns.rank is None else [ns.rank]
    if ns.rank is not None:
        check_rank(ns.rank, ns.world_size)
    loaded = load(ns)
    sm = shard(ns, loaded)
    if ns.out is None:
        for r in ranks:
            print(f"# ---- rank {r} of {ns.world_size} ----")
            print(sm.rank(r).code)
        return 0
    out = Path(ns.out)
    if out.exists() and not out.is_dir():
        raise TPCompileError(f"--out {str(out)!r} exists and is not a folder; name a folder to write into")
    with step(f"running the original and {ns.world_size} simulated ranks once to record shapes"):
        traced = trace(sm, loaded.args, loaded.kwargs)
    name = type(loaded.model).__name__
    with step(f"writing the captured graph's files to {out / 'original'}"):
        written = _write(out / "original", sm.captured, traced.captured_shapes, f"{name} captured (unsharded)",
                         sm.decisions.placement)
    for r in ranks:
        with step(f"writing rank {r}'s files to {out / f'rank{r}'}"):
            written += _write(out / f"rank{r}", sm.rank(r), traced.rank_shapes[r],
                              f"{name} rank {r} of {ns.world_size}")
    for path in written:
        print(path)
    return 0
