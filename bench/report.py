"""The benchmark's markdown report and its two figures, from the result dict bench/run.py builds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tpcompile.report.units import format_bytes

__all__ = ["plot_compile_time", "plot_latency", "render"]

LABEL = {"single": "one process", "hand-written": "hand-written Megatron", "dtensor": "DTensor parallelize_module",
         "tp_transform": "_tp_transform", "tpcompile": "tpcompile"}


SMOKE_NOTE = ("Smoke run (`--tiny`): tiny models and a few repetitions, to check that every contender runs and"
              " counts the same collectives; its timings say nothing about speed, so the timing targets are not"
              " judged. The published numbers come from a full run (`python -m bench`).")


def _bytes(n: int | None) -> str:
    """Bytes as tpcompile prints them, or '-'."""
    return "-" if n is None else format_bytes(n)


def _counts(counts: dict[str, int] | None) -> str:
    """'4 all_reduce, 1 all_gather'."""
    return "-" if counts is None else (", ".join(f"{v} {k}" for k, v in counts.items()) or "none")


def _ratio(entry: dict, other: str) -> str:
    """Paired median ratio of entry to `other`, or '-'."""
    r = entry.get("ratio", {}).get(other)
    return "-" if r is None else f"{r:.2f}x"


def _phase_cells(entry: dict | None) -> list[str]:
    """ms, vs hand-written, vs DTensor, collectives, bytes of one phase."""
    if entry is None or entry.get("status") == "failed":
        why = "" if entry is None else entry["error"].replace("|", "/")
        return [f"failed: {why}", "-", "-", "-", "-"]
    ms = f"{entry['median_ms']:.1f}" + ("" if entry["status"] == "ok" else f" ({entry['status']})")
    return [ms, _ratio(entry, "hand-written"), _ratio(entry, "dtensor"), _counts(entry["counts"]), _bytes(entry["bytes"])]


def _workload_table(wl: dict[str, Any]) -> list[str]:
    """One workload's table: a row per contender."""
    lines = ["| contender | forward ms | fwd vs hand-written | fwd vs DTensor | forward collectives | forward bytes"
             " | train step ms | step vs hand-written | step vs DTensor | step collectives | step bytes"
             " | params per rank | max abs diff |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    for name, row in wl["contenders"].items():
        if row["status"] == "failed":
            lines.append(f"| {LABEL[name]} | failed: {row['error'].replace('|', '/')} |" + " - |" * 11)
            continue
        fwd = row["forward"]
        cells = [LABEL[name], *_phase_cells(fwd), *_phase_cells(row.get("train")), _bytes(row["param_bytes"]),
                 f"{fwd['max_abs_diff']:.1e}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _compile_table(ct: dict[str, Any]) -> list[str]:
    """Capture vs passes per depth, and the per-layer cost of the passes."""
    lines = ["| layers | captured nodes | capture (torch.export) s | passes s | rank-0 rewrite s"
             " | passes + rewrite, % of capture |", "|---:|---:|---:|---:|---:|---:|"]
    for r in ct["rows"]:
        both = r["passes_s"] + r["rewrite_s"]
        lines.append(f"| {r['layers']} | {r['nodes']} | {r['capture_s']:.2f} | {r['passes_s']:.3f} "
                     f"| {r['rewrite_s']:.3f} | {100 * both / r['capture_s']:.1f}% |")
    return lines


def _per_layer(ct: dict[str, Any], key: str) -> str:
    """Milliseconds per added layer of `key` between consecutive depths (equal numbers mean linear)."""
    parts = []
    for a, b in zip(ct["rows"], ct["rows"][1:]):
        dl = b["layers"] - a["layers"]
        if dl > 0:
            parts.append(f"{1e3 * (b[key] - a[key]) / dl:.1f} ms ({a['layers']}->{b['layers']})")
    return ", ".join(parts) or "-"


def _nodes_per_layer(ct: dict[str, Any]) -> str:
    """Captured nodes one more layer adds, from the two deepest rows."""
    a, b = ct["rows"][-2:] if len(ct["rows"]) > 1 else (ct["rows"][0], ct["rows"][0])
    return "-" if b["layers"] == a["layers"] else f"{(b['nodes'] - a['nodes']) / (b['layers'] - a['layers']):.0f}"


def render(res: dict[str, Any]) -> str:
    """The markdown report."""
    ws, wls, ct = res["world_size"], res["workloads"], res["compile_time"]
    device = res.get("device", f"CPU, {res['backend']}")  # results saved before the device was recorded
    smoke = bool(res.get("tiny"))
    lines = ["# tpcompile against other tensor-parallel methods" + (" (smoke run)" if smoke else ""), "",
             f"Produced by `.venv/bin/python -m bench{' --tiny' if smoke else ''}` on {res['date'][:10]} with torch"
             f" {res['torch']}, Python {res['python']}, {res['machine']} CPU: world size {ws} ({device}) over"
             f" 127.0.0.1, one process per rank, one intra-op thread each; whole run {res['wall_s']:.0f} s.", ""]
    if smoke:
        lines += [SMOKE_NOTE, ""]
    if res["targets"]:
        lines += ["Targets (MLP stack at 2 ranks; shard() of the deepest Llama shape):", "",
                  "| check | measured | met |", "|---|---:|:---:|"]
        for t in res["targets"]:
            v = t["value"]
            if isinstance(v, float):
                shown = f"{v:.3f}"
            elif v is None:
                shown = "-"
            elif "seconds" in t["check"]:
                shown = " vs ".join(f"{x:.3f}" for x in v)
            else:
                shown = " vs ".join(_bytes(x) for x in v)
            timing = "ratio" in t["check"] or "seconds" in t["check"]
            met = "not judged" if smoke and timing else ("yes" if t["ok"] else "NO")
            lines.append(f"| {t['check']} | {shown} | {met} |")
        lines.append("")
    spread = []
    for key in ("mlp", "gpt"):
        q = wls.get(key, {}).get("contenders", {}).get("tpcompile", {}).get("forward", {}).get("ratio_quartiles", {})
        if "hand-written" in q:
            spread.append(f"{key} {q['hand-written'][0]:.2f}-{q['hand-written'][1]:.2f}")
    if spread:
        lines += ["Spread of the per-repetition forward ratio tpcompile / hand-written (middle half): "
                  f"{', '.join(spread)}.", ""]
    if "loadavg_start" in res:
        lines += [f"Machine: {res['cpus']} CPUs; load average (1 min) {res['loadavg_start'][0]:.1f} at the start and"
                  f" {res['loadavg_end'][0]:.1f} at the end of the run (the two rank processes account for 2).", ""]
    for key, title in (("mlp", "MLP stack"), ("gpt", "GPT")):
        if key in wls:
            lines += [f"## {title}", "", f"Model: {wls[key]['describe']}.", "", *_workload_table(wls[key]), ""]
    lines += ["![forward and training-step latency per contender](latency.png)", "",
              f"## shard() time for a {'small Llama-shaped' if smoke else 'Llama-2-7B-shaped'} model", "",
              "`LlamaForCausalLM` from transformers' `LlamaConfig` ("
              + ", ".join(f"{k}={v}" for k, v in ct["shape"].items()) + ")"
              f" built on the meta device, world size {ct['world_size']}, fastest of {ct['repeats']} runs per part.", "",
              *_compile_table(ct), "",
              f"Per added layer ({_nodes_per_layer(ct)} captured nodes each):"
              f" passes {_per_layer(ct, 'passes_s')}; rank-0 rewrite {_per_layer(ct, 'rewrite_s')};"
              f" capture {_per_layer(ct, 'capture_s')}. Timings of tens of milliseconds on a loaded"
              " machine move by a few milliseconds between runs.", "",
              "![shard() time against depth](compile_time.png)", "", "## How it is measured", "",
              f"- Contenders run in the same {ws} rank processes, one after another in each repetition, the order"
              " shuffled every repetition (the same order on every rank); each call starts after a barrier"
              " and counts the slowest rank. `one"
              " process` runs the whole model on rank 0 while the other ranks wait.",
              f"- forward ms: median of {res['reps']} forwards under `torch.no_grad()` after {res['warmup']} warm-up"
              f" calls; train step ms: median of {res['train_reps']} steps (forward, loss, backward, SGD lr"
              f" {res['lr']}). Ratios are medians of the per-repetition ratios of two contenders (the machine is"
              " noisy; ratios from the same repetition hold better than absolute times).",
              "- collectives and bytes: counted while one forward / one training step runs, by a dispatch mode that"
              " sees every `torch.distributed` call, DTensor's functional collectives and tpcompile's ops; bytes are"
              " what this rank sends in (its input tensor to each collective). Identical on every rank"
              " (checked); tpcompile's forward count also matches `tpcompile.ops.collectives.record()`.",
              "- params per rank: distinct local parameter storages (a DTensor counts its local shard).",
              "- max abs diff: largest difference of any rank's forward output from the original model's. A"
              " training step is checked by its first two losses against the original's: the first within"
              " 1e-4 relative, the drop from the first to the second within 1% of the original's drop"
              " (a wrong gradient changes the drop); otherwise it is marked wrong gradients.",
              "- hand-written: plain tensors, `dist.all_reduce` after each row split (in place), Megatron's"
              " identity/all-reduce pair for backward (`bench/handwritten_mlp.py`, `bench/handwritten_tp.py`).",
              "- DTensor: `parallelize_module` with `ColwiseParallel` / `RowwiseParallel` on the same layers, the"
              " embedding `RowwiseParallel(input_layouts=Replicate())` and the LM head"
              " `ColwiseParallel(output_layouts=Replicate())`; the GPT's attention reads its head count from the"
              " local q width (DTensor has no CPU SDPA sharding rule, so the heads cannot stay global).",
              "- _tp_transform: `torch.distributed.tensor.experimental._tp_transform.tensor_parallel_transformation`"
              " on `torch.export.export(model)` with the same Linear plan (it handles Linear layers only).",
              "- tpcompile: `tpcompile.shard(model, world_size)` with no plan and its default communication passes"
              " (`comm=None`: in-place all-reduces, gradient buckets), this rank's `sm.rank(r)`.", ""]
    return "\n".join(lines)


def plot_latency(res: dict[str, Any], path: Path) -> None:
    """Grouped bars: forward and training-step median ms per contender, one panel per model."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    wls = res["workloads"]
    fig, axes = plt.subplots(1, len(wls), figsize=(6 * len(wls), 4), squeeze=False)
    for ax, (key, wl) in zip(axes[0], wls.items()):
        names = list(wl["contenders"])
        for j, phase in enumerate(("forward", "train")):
            xs, ys, lo, hi = [], [], [], []
            for i, n in enumerate(names):
                e = wl["contenders"][n].get(phase) or {}
                if "median_ms" in e:
                    xs.append(i + (j - 0.5) * 0.4)
                    ys.append(e["median_ms"])
                    lo.append(e["median_ms"] - e["q1_ms"])
                    hi.append(e["q3_ms"] - e["median_ms"])
            bars = ax.bar(xs, ys, width=0.4, yerr=[lo, hi], capsize=3, label=f"{phase} (median, quartiles)")
            for bar, n in zip(bars, [n for n in names if "median_ms" in (wl["contenders"][n].get(phase) or {})]):
                if wl["contenders"][n][phase]["status"] != "ok":  # wrong output or gradients: hatched
                    bar.set_hatch("//")
                    ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), wl["contenders"][n][phase]["status"],
                            ha="center", va="bottom", fontsize=7)
        for i, n in enumerate(names):
            if wl["contenders"][n]["status"] == "failed":
                ax.text(i, 0, "failed", ha="center", va="bottom", rotation=90, fontsize=8)
        ax.set_xticks(range(len(names)), [LABEL[n].replace(" ", "\n", 1) for n in names], fontsize=8)
        ax.set_ylabel("ms")
        ax.set_title(f"{key}: world size {res['world_size']}, {res['backend']}, 1 thread per rank")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_compile_time(res: dict[str, Any], path: Path) -> None:
    """shard() parts against depth: all three on one scale, then the passes and rewrite alone."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ct = res["compile_time"]
    layers = [r["layers"] for r in ct["rows"]]
    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(11, 4))
    parts = (("capture_s", "capture (torch.export)"), ("passes_s", "passes (annotate, propagate, verify)"),
             ("rewrite_s", "rewrite of one rank"))
    for i, (key, label) in enumerate(parts):
        ax.plot(layers, [r[key] for r in ct["rows"]], marker="o", label=label, color=f"C{i}")
    for i, (key, label) in enumerate(parts[1:], start=1):
        ys = [1e3 * r[key] for r in ct["rows"]]
        zoom.plot(layers, ys, marker="o", label=label, color=f"C{i}")
        # Least-squares line through the points: how far from linear in depth the growth is.
        n = len(layers)
        mx, my = sum(layers) / n, sum(ys) / n
        var = sum((x - mx) ** 2 for x in layers)
        if var > 0:
            slope = sum((x - mx) * (y - my) for x, y in zip(layers, ys)) / var
            zoom.plot(layers, [my + slope * (x - mx) for x in layers], linestyle="--", color="gray", linewidth=1)
    ax.set_title(f"shard(): Llama-2-7B shape on meta, world size {ct['world_size']}")
    ax.set_ylabel("seconds")
    zoom.set_title("passes and rewrite alone (dashed: straight-line fit)")
    zoom.set_ylabel("milliseconds")
    for a in (ax, zoom):
        a.set_xlabel("layers")
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
