"""Shard every Hugging Face architecture of tests/hf_models.py at 2 and 4 ranks and tabulate the result.

Run from the repository root:  python bench/arch_table.py [--out docs/architectures.md] [--readme]
(--arch NAME runs one architecture and writes nothing; --readme also puts the report between the README's
<!-- archs:start --> and <!-- archs:end --> markers, its headings two levels down).
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from hf_models import ALL_ARCHS, SIZES, Arch, balanced_bytes, build, inputs, param_bytes  # noqa: E402

import tpcompile  # noqa: E402
from tpcompile.ops import collectives as C  # noqa: E402

WORLD_SIZES = (2, 4)
EXAMPLE = (2, 8)  # (batch, length) the graph is captured with
RUN = (3, 13)  # (batch, length) it is then run on
TOLERANCE = 1e-4
HELD = 1.25  # a rank may hold at most HELD / world_size of the parameter bytes


def _fmt_counts(counts: dict[str, int]) -> str:
    """'4 all_reduce, 1 all_gather_replicated' style text."""
    return ", ".join(f"{v} {k}" for k, v in counts.items()) or "none"


def run_one(arch: Arch, ws: int, run: tuple[int, int] = RUN, config: Optional[dict] = None) -> dict[str, Any]:
    """Shard arch (built with `config` over its builder's sizes) at world size ws, simulate every rank and compare
    with the original."""
    start = time.perf_counter()
    model = build(arch, **(config or {}))
    torch.manual_seed(1)
    example = inputs(arch, *EXAMPLE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", tpcompile.TPCompileWarning)
        sm = tpcompile.shard(model, ws, example_kwargs=example)
    warned = [str(w.message) for w in caught if issubclass(w.category, tpcompile.TPCompileWarning)]
    torch.manual_seed(2)
    kw = inputs(arch, *run)
    with torch.no_grad():
        ref = model(**kw)[arch.output]
        with C.record() as events:
            outs = tpcompile.simulate(sm, **kw)
    diff = max(float((out[arch.output].detach() - ref).abs().max()) for out in outs)
    counts: dict[str, int] = {}
    for e in events:
        if e.rank == 0 and e.phase == "forward" and e.op in C.FORWARD_COLLECTIVES:
            counts[e.op] = counts.get(e.op, 0) + 1
    local, total = param_bytes(model, sm)
    share = local / total
    return {"diff": diff, "counts": counts, "share": share, "total": total, "warnings": warned,
            "balanced": local / balanced_bytes(model, sm),
            "seconds": time.perf_counter() - start}


# Why an architecture misses the bar, shown under "Known gaps" for each one whose rows fail.
GAPS = {
    "falcon_mamba": (
        "Falcon-Mamba's selective scan runs, without the CUDA kernels, as a Python loop over the tokens, which "
        "torch.export unrolls: the captured graph holds one step per token of the example input, so it runs "
        "at that length only (`shard` warns that the dim is fixed, and the rank graphs refuse other lengths "
        "with a `TPCompileError` whose way out is to shard at the length you run). At that length its blocks "
        "split as Megatron splits Mamba: `in_proj` a column split in x and z segments, the depthwise `conv1d`, "
        "`dt_proj`, `A_log` and `D` by inner channels, `x_proj` and `out_proj` row splits, two all-reduces "
        "per block:"),
}


def table_rows(archs: list, world_sizes: tuple, one: Callable[[Any, int], dict]) -> list[dict]:
    """Per architecture and world size, the fields `one(arch, ws)` measures, or its error: a failing row is a row."""
    rows = []
    for arch in archs:
        for ws in world_sizes:
            row: dict[str, Any] = {"arch": arch.name, "ws": ws}
            try:
                row.update(one(arch, ws))
            except Exception as e:  # noqa: BLE001  a failing row is a row, not a crash
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            rows.append(row)
            print(f"{arch.name} ws={ws}: {'failed' if 'error' in row else 'done'}", file=sys.stderr)
    return rows


def table_main(argv: Optional[list[str]], doc: str, markers: tuple[str, str], world_sizes: tuple,
               one: Callable[[Any, int], dict], render: Callable[[list[dict], float], str]) -> int:
    """A table script's command line: `one(arch, ws)` for every architecture (or the --arch ones) at every world size,
    `render(rows, seconds)` printed and, without --arch, written into its section of docs/architectures.md."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--arch", action="append", default=[], metavar="NAME", help="only this one (writes nothing)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "architectures.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    wall = time.perf_counter()
    rows = table_rows([a for a in ALL_ARCHS if not args.arch or a.name in args.arch], world_sizes, one)
    text = render(rows, time.perf_counter() - wall)
    print(text)
    if not args.arch:
        write_section(args.out, markers, text)
    return 0


def table_lines(rows: list[dict], world_sizes: tuple, cell: Callable[[dict], str],
                notes_of: Callable[[dict], list[str]] = lambda row: []) -> tuple[list[str], list[str]]:
    """(a table row per architecture, its cells `cell(row)` per world size or "failed"; the notes: each failure and
    `notes_of(row)` of the others), in the rows' order."""
    by_arch: dict[str, dict[int, dict]] = {}
    for r in rows:
        by_arch.setdefault(r["arch"], {})[r["ws"]] = r
    lines, notes = [], []
    for name, cells in by_arch.items():
        out = []
        for ws in world_sizes:
            r = cells[ws]
            if "error" in r:
                out.append("failed")
                notes.append(f"- {name} at {ws}: `{r['error'][:300]}`")
            else:
                out.append(cell(r))
                notes += [f"- {name} at {ws}: {note}" for note in notes_of(r)]
        lines.append(f"| {name} | " + " | ".join(out) + " |")
    return lines, notes


def write_section(path: Path, markers: tuple[str, str], text: str) -> None:
    """`text` (which starts and ends with `markers`) in place of that section of the file, where it is (the
    sections keep their order whichever table is rerun), or, new, before the zoo table of docs/architectures.md."""
    old = path.read_text(encoding="utf-8")
    if markers[0] in old and markers[1] in old:
        head, rest = old.split(markers[0], 1)
        path.write_text(head + text.rstrip("\n") + rest.split(markers[1], 1)[1], encoding="utf-8")
        return
    zoo = "<!-- zoo:start -->"
    new = old.replace(zoo, text + "\n" + zoo, 1) if zoo in old else old.rstrip("\n") + "\n\n" + text
    path.write_text(new, encoding="utf-8")


def write_head(path: Path, text: str) -> None:
    """`text` as the file's head, keeping the sections the other tables write after it (from the first
    `<!-- name:start -->` marker on)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    found = re.search(r"^<!-- [\w-]+:start -->$", old, flags=re.M)
    path.write_text(text.rstrip("\n") + "\n\n" + old[found.start():] if found else text, encoding="utf-8")


def passed(row: dict[str, Any]) -> bool:
    """Equal within TOLERANCE, at most HELD / ws of the parameter bytes per rank, and no warning."""
    return ("error" not in row and row["diff"] <= TOLERANCE and row["share"] <= HELD / row["ws"]
            and not row["warnings"])


def render(rows: list[dict], wall_s: float) -> str:
    """The markdown report."""
    import transformers

    lines = [
        "# Hugging Face architectures",
        "",
        "Generated by `python bench/arch_table.py` from live runs on"
        f" {datetime.date.today().isoformat()} with torch {torch.__version__} and transformers"
        f" {transformers.__version__} (whole run {wall_s:.0f} s).",
        "",
        "| architecture | world size | max abs diff | forward collectives | params per rank | held × ws | warnings"
        " | status |",
        "|---|---:|---:|---|---:|---:|---:|:---:|",
    ]
    notes = []
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['arch']} | {r['ws']} | - | - | - | - | - | ✗ |")
            notes.append(f"- {r['arch']} at world size {r['ws']} failed: `{r['error']}`")
            continue
        lines.append(f"| {r['arch']} | {r['ws']} | {r['diff']:.1e} | {_fmt_counts(r['counts'])} "
                     f"| {100 * r['share']:.1f}% of {r['total'] / 2**10:.0f} KiB | {r['share'] * r['ws']:.2f} "
                     f"| {len(r['warnings'])} | {'✓' if passed(r) else '✗'} |")
        for why in r["warnings"]:
            notes.append(f"- {r['arch']} at world size {r['ws']}: {why}")
    sizes = ", ".join(f"{k}={v}" for k, v in SIZES.items())
    lines += [
        "",
        "## How each row is made",
        "",
        "- Models: `tests/hf_models.py`, randomly initialised from their config classes with a fixed"
        f" seed ({sizes}, plus each builder's own extras there; GPT-2 uses n_layer=2, n_embd=64,"
        " n_head=4), fp32, eval mode. A builder whose sizes differ says why in its docstring (mixtures of"
        " experts: 4 experts, top 2; DeepSeek-V3's latents; GPTBigCode's 8 query heads for its one kv head).",
        f"- `tpcompile.shard(model, ws, example_kwargs=inputs(arch, {EXAMPLE[0]}, {EXAMPLE[1]}))`, then"
        f" `tpcompile.simulate` on a new batch of shape ({RUN[0]}, {RUN[1]}), so each graph also runs"
        " at a batch and length it was not captured with.",
        "- max abs diff: largest absolute difference between any rank's output (`logits`, for BART and Whisper"
        " the decoder's; BERT and ALBERT: `last_hidden_state`) and the original model's. BART gets"
        " `decoder_input_ids` as long as its `input_ids`; Whisper gets (batch, 16 mel bins, 32 frames)"
        " `input_features` and `decoder_input_ids` of the length.",
        f"- status: ✓ when the max abs diff is at most {TOLERANCE:g}, held × ws at most {HELD:g} and `shard`"
        " warned nothing (every split dim of these configs divides by 2 and 4).",
        "- forward collectives: communicating collectives one rank executed in that forward"
        " (`tpcompile.ops.collectives.record()`).",
        "- params per rank: bytes of one rank's parameter slices over the model's parameter bytes"
        " (from `sm.plan.parameters`, tied weights once); held × ws: that share times the world size (1.00 is a"
        f" perfect split, {HELD:g} the bar).",
        "- warnings: `TPCompileWarning`s raised by `shard` (each listed below).",
    ]
    failing = sorted({r["arch"] for r in rows if not passed(r)}, key=[r["arch"] for r in rows].index)
    if failing:
        lines += ["", "## Known gaps", ""]
        for name in failing:
            lines.append(f"- {name}: {GAPS.get(name, 'not explained yet; see the warnings and failures below.')}")
            for r in rows:
                if r["arch"] == name and "fixed" in r:
                    f = r["fixed"]
                    others = [w for w in f["warnings"] if "is fixed at" not in w]
                    lines.append(f"  At world size {r['ws']} on a batch of ({RUN[0]}, {EXAMPLE[1]}), the captured length:"
                                 f" max abs diff {f['diff']:.1e}, forward collectives {_fmt_counts(f['counts'])},"
                                 f" held × ws {f['share'] * r['ws']:.2f}, {len(others)} warning(s) besides the"
                                 f" fixed length.")
    if notes:
        lines += ["", "## Warnings and failures", "", *notes]
    return "\n".join(lines) + "\n"


def write_readme(readme: Path, docs: Path) -> None:
    """The README's archs block: the whole of `docs` (every section after this table too), headings two levels
    down, as bench/update_readme.py copies it."""
    from bench.update_readme import nest, replace_between
    readme.write_text(replace_between(readme.read_text(), "archs", nest(docs.read_text())))


def main(argv: list[str] | None = None) -> int:
    """Run every architecture at every world size, write the report and print its table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "architectures.md")
    ap.add_argument("--readme", action="store_true", help="also write the report into README.md's archs block")
    ap.add_argument("--arch", action="append", default=[], metavar="NAME",
                    help="only this architecture (repeatable); prints the table, writes nothing")
    args = ap.parse_args(argv)
    names = [a.name for a in ALL_ARCHS]
    unknown = [n for n in args.arch if n not in names]
    if unknown:
        ap.error(f"unknown architecture {', '.join(unknown)}; known: {', '.join(names)}")
    archs = [a for a in ALL_ARCHS if not args.arch or a.name in args.arch]
    torch.set_num_threads(1)
    wall = time.perf_counter()
    rows = table_rows(archs, WORLD_SIZES, run_one)
    for row in rows:
        if "the capture fixed that dim" in row.get("error", ""):  # what it does at the length it was captured with
            row["fixed"] = run_one(next(a for a in archs if a.name == row["arch"]), row["ws"], (RUN[0], EXAMPLE[1]))
    text = render(rows, time.perf_counter() - wall)
    print("\n".join(line for line in text.splitlines() if line.startswith("|")))
    print("\n".join(line for line in text.splitlines() if line.startswith(("- ", "  At "))))
    if not args.arch:
        write_head(args.out, text)
        print(f"\nwrote {args.out}")
    if args.readme and not args.arch:
        write_readme(ROOT / "README.md", args.out)
        print("wrote the README's archs block")
    return 0 if all(passed(r) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
