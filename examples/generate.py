"""Generation with a KV cache split by heads across the ranks of a torchrun launch:

    torchrun --nproc-per-node 2 examples/generate.py --model hf:llama --batch 2 --max-new-tokens 32
    torchrun --nproc-per-node 2 examples/generate.py                   # the bundled GPT
    python examples/generate.py                                         # one rank, no torchrun needed

Every rank builds the same model (seed 0), shards it with tpcompile.shard_generation and keeps
only its heads of the key/value cache; the prompt runs once (prefill), then one token per step.
The logits come back whole on every rank, so all ranks pick the same token. Rank 0 prints the
tokens and checks them against the unsharded model's generate (greedy). The models are untrained
(random weights), so greedy decoding soon repeats itself: that is the model, not the sharding.
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

import tpcompile
from tpcompile.cli.script import run_script
from tpcompile.cli.common import parse_config
from tpcompile.cli.generate import vocab_size
from tpcompile.models.spec import load_model
from tpcompile.generate.reference import example_prompts, reference_generate
from tpcompile.runtime import init_from_env, shutdown


def main() -> None:
    """Shard for generation over the launch's ranks (or run as one rank), generate, report from rank 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt", help="a MODEL string: gpt, hf:llama, hf:gpt2, file.py:NAME, ...")
    parser.add_argument("--max-new-tokens", "--tokens", type=int, default=16, help="tokens to generate")
    parser.add_argument("--prompt-len", type=int, default=8, help="the longest prompt")
    parser.add_argument("--batch", type=int, default=1, help="prompts, each 2 tokens shorter, left-padded")
    parser.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                        help="a config value of the model (repeatable), as tpcompile's --config")
    parser.add_argument("--json", action="store_true", help="rank 0 prints one JSON line instead of text")
    opts = parser.parse_args()
    owned = not dist.is_initialized()
    torch.set_num_threads(1)
    rank, world = init_from_env(standalone=True)
    model, _, _ = load_model(opts.model, parse_config(opts.config))
    vocab = vocab_size(model, opts.model)
    gen = tpcompile.shard_generation(model, world, max_seq_len=opts.prompt_len + opts.max_new_tokens,
                                     max_batch_size=opts.batch)
    ids, mask = example_prompts(vocab, opts.batch, opts.prompt_len)
    out = gen.rank(rank).generate(ids, attention_mask=mask, max_new_tokens=opts.max_new_tokens)
    stats = gen.rank(rank).stats
    if rank == 0:
        want = reference_generate(model, ids, mask, opts.max_new_tokens)
        same = torch.equal(out, want)
        decode_ms = 1e3 * sum(stats.decode_s) / max(len(stats.decode_s), 1)
        report = {"world_size": world, "backend": dist.get_backend(), "model": opts.model, "same": same,
                  "tokens": out[:, opts.prompt_len:].tolist(), "reference": want[:, opts.prompt_len:].tolist(),
                  "first_token_ms": 1e3 * stats.prefill_s, "decode_ms_per_token": decode_ms,
                  "tokens_per_s": stats.tokens_per_s, "cache_bytes_per_rank": gen.cache_bytes(rank),
                  "cache_bytes_unsharded": gen.unsharded_cache_bytes}
        if opts.json:
            print(json.dumps(report))
        else:
            prompts = [p[m.bool()].tolist() for p, m in zip(ids, mask)]
            print(f"world size {world} on {dist.get_backend()}: {opts.model}, prompts {prompts}")
            for row in report["tokens"]:
                print(f"generated {row}")
            print("OK (same tokens as the unsharded model)" if same else "MISMATCH")
            print(f"first token {report['first_token_ms']:.1f} ms, then {decode_ms:.1f} ms per token; cache "
                  f"{gen.cache_bytes(rank)} of {gen.unsharded_cache_bytes} bytes on this rank")
    shutdown(destroy=owned)  # barrier, then the group destroyed with its threads before the interpreter exits


if __name__ == "__main__":
    raise SystemExit(run_script(main))  # a user error: one line from rank 0, exit 2
