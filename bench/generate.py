"""The generation bench: decode latency and tokens/s of tpcompile, the unsharded model and HF's tp_plan="auto".

    .venv/bin/python -m bench generate [--readme]      (or python bench/generate.py)

A random Llama (saved locally with save_pretrained, as a user's checkpoint would be) generates
greedily from one prompt: unsharded in one process, and at world size 2 on gloo under torchrun with
tpcompile.shard_generation and with `from_pretrained(..., tp_plan="auto")`. Every process runs one
thread. Writes bench/results/generate.json and generate.md; --readme copies the table into README.md
between the generate markers.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a file: bench.update_readme is imported from the repository root
    sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"
RANK_SCRIPT = ROOT / "bench" / "generate_rank.py"
# Big enough that a decode step is mostly arithmetic, small enough for two CPU cores.
MODEL = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             vocab_size=8192, max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=0)
CONTENDERS = (("unsharded", 1), ("tpcompile", 2), ("hf-tp", 2))
LABELS = {"unsharded": "unsharded (HF generate, 1 process)", "tpcompile": "tpcompile.shard_generation",
          "hf-tp": 'HF from_pretrained(tp_plan="auto")'}


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


def run_contender(name: str, world: int, model_dir: Path, out: Path, opts: argparse.Namespace) -> dict:
    """One contender in its own process(es); its JSON, or the error it ended with."""
    common = ["--contender", name, "--model-dir", str(model_dir), "--prompt-len", str(opts.prompt_len),
              "--new-tokens", str(opts.new_tokens), "--repeats", str(opts.repeats), "--out", str(out)]
    if world == 1:
        cmd = [sys.executable, str(RANK_SCRIPT), *common]
    else:
        from tpcompile.runtime import free_port
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
               "--master-port", str(free_port()), str(RANK_SCRIPT), *common]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=opts.timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"contender": name, "world_size": world, "error": f"timed out after {opts.timeout} s"}
    if proc.returncode != 0 or not out.exists():
        tail = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if ln.strip()][-3:]
        return {"contender": name, "world_size": world, "error": f"exit {proc.returncode}: " + " | ".join(tail)}
    result = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - start
    return result


def render(result: dict) -> str:
    """The report as markdown: one row per contender, then how it was measured."""
    rows = result["contenders"]
    ref = next((r.get("tokens") for r in rows if r["contender"] == "unsharded"), None)
    m = result["model"]
    lines = ["# Generation: decode latency at world size 2 (gloo)", "",
             f"Random Llama ({m['num_hidden_layers']} layers, width {m['hidden_size']}, {m['num_attention_heads']} "
             f"heads, {m['num_key_value_heads']} kv heads, vocabulary {m['vocab_size']}, float32), one prompt of "
             f"{result['prompt_len']} tokens, {result['new_tokens']} new tokens (greedy); {result['device']}, one "
             f"thread per process; median of {result['repeats']} calls after a warm-up.", "",
             "| contender | ranks | first token (ms) | decode (ms/token) | tokens/s | cache bytes per rank | "
             "tokens = unsharded |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        label = LABELS[r["contender"]]
        if "error" in r:
            lines.append(f"| {label} | {r['world_size']} | failed: {r['error']} | | | | |")
            continue
        same = "yes" if r["tokens"] == ref else "no"
        cache = f"{r['cache_bytes_per_rank']:,}"
        if r.get("cache_bytes_unsharded"):  # tpcompile: the same static cache unsharded, and this rank's share of it
            share = r["cache_bytes_unsharded"] / r["cache_bytes_per_rank"]
            cache += f" (1/{share:g} of {r['cache_bytes_unsharded']:,})"
        lines.append(f"| {label} | {r['world_size']} | {r['first_token_ms']:.1f} | {r['decode_ms']:.2f} | "
                     f"{r['tokens_per_s']:.1f} | {cache} | {same} |")
    lines += ["", "## How it is measured", "",
              "- first token: prefill of the prompt up to the first new token; decode: the median time of one "
              "step after it (tpcompile: its generator's per-step clock; Hugging Face: a streamer's timestamps); "
              "tokens/s: new tokens over the whole generate call.",
              "- cache bytes per rank: tpcompile's static cache (prompt + new tokens, this rank's kv heads), and in "
              "brackets its share of the same cache unsharded; Hugging Face's DynamicCache after the call (one "
              "position fewer: the last token is never fed back), this rank's part.",
              f"- machine: {result['cpus']} CPUs, load average {result['loadavg_start'][0]:.1f} at the start and "
              f"{result['loadavg_end'][0]:.1f} at the end (other work on the machine slows every contender); "
              f"torch {result['torch']}, transformers {result['transformers']}, {result['date']}.",
              "- produced by `python -m bench generate` (bench/generate.py, bench/generate_rank.py)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Save the model, run the three contenders one after another, write the report."""
    ap = argparse.ArgumentParser(prog="python -m bench generate", description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=900, help="seconds each contender may take")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--readme", action="store_true", help="also copy the table into README.md")
    opts = ap.parse_args(argv)
    import torch
    import transformers
    load_start = list(os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="tpcompile-generate-") as tmp:
        model_dir = Path(tmp) / "model"
        config = save_model(model_dir)
        rows = []
        for name, world in CONTENDERS:
            print(f"{name} ({world} process{'es' if world > 1 else ''})...", flush=True)
            rows.append(run_contender(name, world, model_dir, Path(tmp) / f"{name}.json", opts))
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
              "device": "CPU, gloo", "cpus": os.cpu_count(), "model": config, "prompt_len": opts.prompt_len,
              "new_tokens": opts.new_tokens, "repeats": opts.repeats, "contenders": rows,
              "loadavg_start": load_start, "loadavg_end": list(os.getloadavg())}
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    (opts.out_dir / "generate.json").write_text(json.dumps(result, indent=1) + "\n")
    text = render(result)
    (opts.out_dir / "generate.md").write_text(text)
    print(text)
    if opts.readme:
        from bench.update_readme import README, nest, replace_between
        README.write_text(replace_between(README.read_text(), "generate", nest(text, 2)))
        print(f"updated {README}")
    return 0 if all("error" not in r or r["contender"] == "hf-tp" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
