"""The generation bench: decode latency of tpcompile, the unsharded model and HF's tp_plan="auto", in one run.

    .venv/bin/python -m bench generate [--write] [--readme]      (or python bench/generate.py)

A random Llama (saved locally with save_pretrained, as a user's checkpoint would be) generates
greedily from one prompt. One torchrun launch of 2 gloo processes (one thread each) holds every
contender: the unsharded model (run by rank 0 alone), tpcompile.shard_generation at world size 2
and `from_pretrained(..., tp_plan="auto")` at world size 2, timed in interleaved repetitions
together with a probe of one small all-reduce between busy ranks (bench/generate_rank.py). The
modeled limit of a decode step is the unsharded step / world size + the step's collectives x that
latency. Writes bench/results/generate.json and generate.md; --write puts the table into
docs/generate.md between its decode markers, --readme into README.md between the generate markers.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a file: bench.update_readme is imported from the repository root
    sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"
DOC = ROOT / "docs" / "generate.md"
RANK_SCRIPT = ROOT / "bench" / "generate_rank.py"
WORLD = 2
# Big enough that a decode step is mostly arithmetic, small enough for two CPU cores.
MODEL = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             vocab_size=8192, max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=0)
LABELS = {"unsharded": "unsharded (HF generate, 1 process)", "tpcompile": "tpcompile.shard_generation",
          "hf-tp": 'HF from_pretrained(tp_plan="auto")'}
# the targets: decode against HF tp_plan and the modeled limit, first token against HF tp_plan
TARGETS = (("decode tpcompile / HF tp_plan", "decode_vs_hf", 1.0), ("decode tpcompile / modeled limit",
           "decode_vs_limit", 1.25), ("first token tpcompile / HF tp_plan", "first_vs_hf", 1.0))


def save_model(path: Path) -> dict:
    """The random Llama, saved as safetensors; its config as a dict."""
    import torch
    import transformers
    transformers.logging.set_verbosity_error()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL)).eval()
    model.save_pretrained(path)
    return {k: v for k, v in MODEL.items() if v is not None}


def run_ranks(model_dir: Path, out: Path, opts: argparse.Namespace) -> dict:
    """The torchrun launch of every contender; rank 0's JSON, or the error it ended with."""
    from tpcompile.runtime import free_port
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "--master-port",
           str(free_port()), str(RANK_SCRIPT), "--model-dir", str(model_dir), "--prompt-len", str(opts.prompt_len),
           "--new-tokens", str(opts.new_tokens), "--repeats", str(opts.repeats), "--out", str(out),
           "--contenders", opts.contenders]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=opts.timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {opts.timeout} s"}
    if proc.returncode != 0 or not out.exists():
        tail = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if ln.strip()][-4:]
        return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}
    return json.loads(out.read_text())


def paired(reps: list[dict], setup: dict) -> dict:
    """Per repetition: the modeled limit and tpcompile's ratios to it and to HF tp_plan; medians and ranges."""
    n_coll = setup.get("tpcompile", {}).get("collectives_per_step")
    rows: dict[str, list[float]] = {"limit_ms": [], "busy_ms": [], "decode_vs_hf": [], "decode_vs_limit": [],
                                    "first_vs_hf": []}
    for rep in reps:
        step = {n: statistics.median(rep[n]["decode_s"]) for n in LABELS if n in rep}
        rows["busy_ms"].append(1e3 * rep["latency"]["busy_s"])
        if "unsharded" in step and n_coll is not None:
            limit = step["unsharded"] / WORLD + n_coll * rep["latency"]["busy_s"]
            rows["limit_ms"].append(1e3 * limit)
            if "tpcompile" in step:
                rows["decode_vs_limit"].append(step["tpcompile"] / limit)
        if "tpcompile" in step and "hf-tp" in step:
            rows["decode_vs_hf"].append(step["tpcompile"] / step["hf-tp"])
            rows["first_vs_hf"].append(rep["tpcompile"]["first_s"] / rep["hf-tp"]["first_s"])
    return {k: {"median": statistics.median(v), "min": min(v), "max": max(v), "values": v}
            for k, v in rows.items() if v}


def render(result: dict) -> str:
    """The report as markdown: one row per contender, the modeled limit, the targets, then how it was measured."""
    m, ranks = result["model"], result["ranks"]
    summary, setup, errors = ranks.get("summary", {}), ranks.get("setup", {}), dict(ranks.get("errors", {}))
    if "error" in ranks:
        errors = {n: ranks["error"] for n in LABELS}
    ref = summary.get("unsharded", {}).get("tokens")
    lines = [f"Random Llama ({m['num_hidden_layers']} layers, width {m['hidden_size']}, {m['num_attention_heads']} "
             f"heads, {m['num_key_value_heads']} kv heads, vocabulary {m['vocab_size']}, float32), one prompt of "
             f"{result['prompt_len']} tokens, {result['new_tokens']} new tokens (greedy); {result['device']}, one "
             f"thread per process; all contenders in one process group, {result['repeats']} interleaved "
             f"repetitions after a warm-up, medians.", "",
             "| contender | ranks | first token (ms) | decode (ms/token) | tokens/s | cache bytes per rank | "
             "tokens = unsharded |", "|---|---|---|---|---|---|---|"]
    for name, label in LABELS.items():
        world = 1 if name == "unsharded" else WORLD
        if name in errors:
            lines.append(f"| {label} | {world} | failed: {errors[name]} | | | | |")
            continue
        if name not in summary:
            continue
        r = summary[name]
        cache = f"{r['cache_bytes_per_rank']:,}"
        unsharded = setup.get(name, {}).get("cache_bytes_unsharded")
        if unsharded:  # tpcompile: the same static cache unsharded, and this rank's share of it
            cache += f" (1/{unsharded / r['cache_bytes_per_rank']:g} of {unsharded:,})"
        same = "yes" if r["tokens"] == ref else "no"
        lines.append(f"| {label} | {world} | {r['first_token_ms']:.1f} | {r['decode_ms']:.2f} | "
                     f"{r['tokens_per_s']:.1f} | {cache} | {same} |")
    p = result.get("paired", {})
    if "limit_ms" in p:
        n_coll = setup["tpcompile"]["collectives_per_step"]
        lines.append(f"| modeled limit: unsharded / {WORLD} + {n_coll} collectives x {p['busy_ms']['median']:.2f} ms | "
                     f"{WORLD} | | {p['limit_ms']['median']:.2f} | | | |")
    if p:
        lines += ["", "| target | median per repetition (min-max) | met |", "|---|---|---|"]
        for text, key, limit in TARGETS:
            if key in p:
                v = p[key]
                lines.append(f"| {text} <= {limit:g} | {v['median']:.2f} ({v['min']:.2f}-{v['max']:.2f}) | "
                             f"{'yes' if v['median'] <= limit else 'NO'} |")
    lat = p.get("busy_ms")
    lines += ["", "How it is measured:", "",
              "- first token: from the generate call to the first new token; decode: the median time of one step "
              "after it (tpcompile: its generator's per-step clock; Hugging Face: a streamer's timestamps); "
              "tokens/s: new tokens over the whole generate call. Ratios are taken per repetition (the same load "
              "for every contender), then the median.",
              "- modeled limit: the unsharded step split perfectly over the ranks plus each collective of "
              "tpcompile's step at the latency of one small all-reduce between busy ranks: each rank runs its "
              "share of every block's matmuls for one token (weights of the model's sizes, read from memory as in "
              "a decode step), the attention's then the MLP's, each followed by an all-reduce of one token's "
              "hidden state, against the same matmuls alone" +
              (f" ({lat['median']:.2f} ms median, {lat['min']:.2f}-{lat['max']:.2f})" if lat else "") + ".",
              "- cache bytes per rank: tpcompile's static cache (prompt + new tokens, this rank's kv heads), and in "
              "brackets its share of the same cache unsharded; Hugging Face's DynamicCache after the call (one "
              "position fewer: the last token is never fed back), this rank's part.",
              f"- machine: {result['cpus']} CPUs, load average {result['loadavg_start'][0]:.1f} at the start and "
              f"{result['loadavg_end'][0]:.1f} at the end (other work on the machine slows every contender); "
              f"torch {result['torch']}, transformers {result['transformers']}, {result['date']}.",
              "- produced by `python -m bench generate` (bench/generate.py, bench/generate_rank.py)."]
    return "\n".join(lines) + "\n"


def write_between(path: Path, key: str, body: str) -> None:
    """path's text between <!-- key:start --> and <!-- key:end --> replaced by body."""
    from bench.update_readme import replace_between
    path.write_text(replace_between(path.read_text(), key, body))


def main(argv: list[str] | None = None) -> int:
    """Save the model, run every contender in one launch, write the report."""
    ap = argparse.ArgumentParser(prog="python -m bench generate", description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--contenders", default=",".join(LABELS), help="comma-separated subset of " + ", ".join(LABELS))
    ap.add_argument("--timeout", type=int, default=1200, help="seconds the launch may take")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--write", action="store_true", help="also put the table into docs/generate.md")
    ap.add_argument("--readme", action="store_true", help="also copy the table into README.md")
    opts = ap.parse_args(argv)
    import torch
    import transformers
    load_start = list(os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="tpcompile-generate-") as tmp:
        model_dir = Path(tmp) / "model"
        config = save_model(model_dir)
        print(f"{opts.contenders} in one launch of {WORLD} processes, {opts.repeats} repetitions...", flush=True)
        ranks = run_ranks(model_dir, Path(tmp) / "ranks.json", opts)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
              "device": "CPU, gloo", "cpus": os.cpu_count(), "model": config, "prompt_len": opts.prompt_len,
              "new_tokens": opts.new_tokens, "repeats": opts.repeats, "ranks": ranks,
              "paired": paired(ranks.get("repetitions", []), ranks.get("setup", {})),
              "loadavg_start": load_start, "loadavg_end": list(os.getloadavg())}
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    (opts.out_dir / "generate.json").write_text(json.dumps(result, indent=1) + "\n")
    text = render(result)
    (opts.out_dir / "generate.md").write_text("# Generation: decode latency at world size 2 (gloo)\n\n" + text)
    print(text)
    if opts.write:
        write_between(DOC, "decode", text)
        print(f"updated {DOC}")
    if opts.readme:
        from bench.update_readme import README, nest
        write_between(README, "generate", nest("# Generation: decode latency at world size 2 (gloo)\n\n" + text, 2))
        print(f"updated {README}")
    return 1 if "error" in ranks or set(ranks.get("errors", {})) - {"hf-tp"} else 0


if __name__ == "__main__":
    sys.exit(main())
