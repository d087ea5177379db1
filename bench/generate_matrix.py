"""The generation matrix: greedy tokens of every architecture, sharded, against Hugging Face generate.

    .venv/bin/python bench/generate_matrix.py [--write]

Six small random Hugging Face models (llama, mistral, qwen2, gpt2, gemma3, phi) generate 32 tokens
greedily for two prompts of different lengths (left padding, attention mask) at world sizes 2 and 4
in the simulator and at 2 under torchrun (gloo, examples/generate.py); each run is compared token for
token with the unsharded model's `generate(do_sample=False)`. --write puts the table into
docs/generate.md between its matrix markers. tests/test_generate_matrix.py (pytest -m slow) runs the
same cases.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ARCHS = ("llama", "mistral", "qwen2", "gpt2", "gemma3", "phi")
NEW_TOKENS, PROMPT_LEN, BATCH = 32, 7, 2


def small_model(arch: str = "llama") -> Any:
    """A small random Hugging Face causal LM (2 layers, width 64, 4 heads, vocabulary 128), seed 0, eval mode.

    Llama, mistral, qwen2 and gemma3 have 2 kv heads (shared pieces at 4 ranks); mistral and gemma3
    slide a window of 8 tokens, shorter than prompt + new tokens, and gemma3 mixes a sliding and a
    full layer (two masks per step).
    """
    import torch
    import transformers as t
    t.logging.set_verbosity_error()
    sizes = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128,
                 max_position_embeddings=64)
    gqa = dict(sizes, intermediate_size=128, num_key_value_heads=2)
    build = {
        "llama": lambda: t.LlamaForCausalLM(t.LlamaConfig(**gqa)),
        "mistral": lambda: t.MistralForCausalLM(t.MistralConfig(**gqa, sliding_window=8)),
        "qwen2": lambda: t.Qwen2ForCausalLM(t.Qwen2Config(**gqa)),
        "gpt2": lambda: t.GPT2LMHeadModel(t.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128,
                                                        n_positions=64, eos_token_id=127, bos_token_id=127)),
        "gemma3": lambda: t.Gemma3ForCausalLM(t.Gemma3TextConfig(
            **gqa, head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
        "phi": lambda: t.PhiForCausalLM(t.PhiConfig(**sizes, intermediate_size=128)),
    }
    if arch not in build:
        raise ValueError(f"unknown arch {arch!r}; choose from {', '.join(build)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build[arch]()
    return model.eval()


def check_simulated(arch: str, world_size: int) -> dict:
    """Shard, generate on every simulated rank, compare with HF generate; what was seen."""
    import warnings

    import torch

    import tpcompile
    from tpcompile.generate.reference import example_prompts, reference_generate

    model = small_model(arch)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tpcompile.TPCompileWarning)
        gen = tpcompile.shard_generation(model, world_size, max_seq_len=PROMPT_LEN + NEW_TOKENS, max_batch_size=BATCH)
    ids, mask = example_prompts(model.config.vocab_size, BATCH, PROMPT_LEN, seed=1)
    outs = tpcompile.simulate_ranks(world_size, lambda r: gen.rank(r).generate(
        ids, attention_mask=mask, max_new_tokens=NEW_TOKENS))
    want = reference_generate(model, ids, mask, NEW_TOKENS)
    return {"arch": arch, "runtime": f"simulator, {world_size} ranks", "same": all(torch.equal(o, want) for o in outs),
            "new_tokens": int(want.shape[1] - PROMPT_LEN), "cache_bytes": gen.cache_bytes(0),
            "cache_bytes_unsharded": gen.unsharded_cache_bytes, "seconds": time.perf_counter() - start}


def check_torchrun(arch: str, world_size: int = 2, timeout: int = 900) -> dict:
    """examples/generate.py on this arch under torchrun (gloo); rank 0's JSON report."""
    from tpcompile.runtime import free_port
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world_size), "--master-port",
           str(free_port()), str(ROOT / "examples" / "generate.py"), "--model",
           "bench/generate_matrix.py:small_model", "--config", f"arch={arch}", "--batch", str(BATCH),
           "--prompt-len", str(PROMPT_LEN), "--max-new-tokens", str(NEW_TOKENS), "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TPCOMPILE_TIMEOUT_S": "300"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"arch": arch, "runtime": f"torchrun gloo, {world_size} ranks", "same": False,
                "error": f"exit {proc.returncode}: {rank_error(proc.stderr)}"}
    report = json.loads(lines[-1])
    return {"arch": arch, "runtime": f"torchrun {report['backend']}, {world_size} ranks", "same": report["same"],
            "new_tokens": len(report["tokens"][0]), "cache_bytes": report["cache_bytes_per_rank"],
            "cache_bytes_unsharded": report["cache_bytes_unsharded"], "seconds": time.perf_counter() - start}


def rank_error(stderr: str) -> str:
    """The ranks' own error lines from a failed torchrun's stderr (its summary banner says only that a rank failed)."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception)\b", ln.split("]:")[-1].strip())]
    return " | ".join(dict.fromkeys(errors[-3:] or lines[-3:]))


def table(rows: list[dict]) -> str:
    """The results as a markdown table."""
    lines = ["| architecture | runtime | new tokens | tokens = HF generate | cache bytes per rank (unsharded) |",
             "|---|---|---|---|---|"]
    for r in rows:
        cache = f"{r['cache_bytes']:,} ({r['cache_bytes_unsharded']:,})" if "cache_bytes" in r else r.get("error", "")
        lines.append(f"| {r['arch']} | {r['runtime']} | {r.get('new_tokens', '')} | "
                     f"{'yes' if r['same'] else 'NO'} | {cache} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run every case; print the table, and write it into docs/generate.md with --write."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="put the table into docs/generate.md")
    ap.add_argument("--archs", default=",".join(ARCHS))
    opts = ap.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    rows = []
    for arch in opts.archs.split(","):
        for ws in (2, 4):
            rows.append(check_simulated(arch, ws))
            print(json.dumps(rows[-1]), flush=True)
        rows.append(check_torchrun(arch))
        print(json.dumps(rows[-1]), flush=True)
    text = table(rows)
    print(text)
    if opts.write:
        sys.path.insert(0, str(ROOT))
        from bench.update_readme import replace_between
        doc = ROOT / "docs" / "generate.md"
        stamp = (f"Produced by `python bench/generate_matrix.py --write` on {time.strftime('%Y-%m-%d')}, "
                 f"torch {torch.__version__}; {NEW_TOKENS} new tokens for {BATCH} prompts of {PROMPT_LEN} and "
                 f"{PROMPT_LEN - 2} tokens.\n\n")
        doc.write_text(replace_between(doc.read_text(), "matrix", stamp + text))
        print(f"updated {doc}")
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
