"""`tpcompile generate MODEL -w N`: generate with the KV cache on every rank, compare with the unsharded model."""
from __future__ import annotations

import argparse
import re
import time
import warnings

import torch

import tpcompile
from tpcompile.cli.common import one_line, parse_config, world_size
from tpcompile.cli.progress import note, step
from tpcompile.models.spec import ACCEPTED_FORMS, load_model
from tpcompile.errors import TPCompileError
from tpcompile.report.units import format_bytes
from tpcompile.report.wording import short_warning


def add_parser(sub: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    """Register the subcommand."""
    p = sub.add_parser(
        "generate", parents=[parent], help="generate with a KV cache split by heads; compare with the unsharded model",
        description="Shard MODEL for generation (tpcompile.shard_generation: one graph for prefill and decode, the "
                    "key/value cache split by heads), run every rank in the simulator on --batch left-padded "
                    "prompts of up to --prompt-len tokens, generate --max-new-tokens greedily, and compare each "
                    "rank's tokens with the unsharded model's generate. Prints both, the time to first token and "
                    "tokens per second of rank 0, and the cache bytes per rank.",
        epilog=f"MODEL is one of: {ACCEPTED_FORMS}; a decoder-only language model (hf:llama, hf:gpt2, gpt, ...).")
    p.add_argument("model", metavar="MODEL", help=ACCEPTED_FORMS)
    p.add_argument("-w", "--world-size", type=world_size, default=2, metavar="N", help="number of ranks (default 2)")
    p.add_argument("--prompt-len", type=world_size, default=8, metavar="L", help="longest prompt (default 8)")
    p.add_argument("--max-new-tokens", type=world_size, default=16, metavar="K", help="new tokens (default 16)")
    p.add_argument("--batch", type=world_size, default=1, metavar="B",
                   help="prompts, each 2 tokens shorter than the one before, left-padded (default 1)")
    p.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value of the model (repeatable), as for the other subcommands")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts' token ids (default 0)")
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    """Shard, generate on every simulated rank, compare; 0 when every rank's tokens equal the unsharded model's."""
    from tpcompile.generate.reference import example_prompts, reference_generate

    with step(f"loading {ns.model}"):
        model, _, _ = load_model(ns.model, parse_config(ns.config))
    vocab = vocab_size(model, ns.model)
    ws, length, new = ns.world_size, ns.prompt_len, ns.max_new_tokens
    print(f"sharding {type(model).__name__} for generation across {ws} ranks (cache: {ns.batch} x "
          f"{length + new} tokens)...", flush=True)
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", tpcompile.TPCompileWarning)
        try:
            with step(f"capturing {type(model).__name__} with its cache and sharding it across {ws} ranks"):
                gen = tpcompile.shard_generation(model, ws, max_seq_len=length + new, max_batch_size=ns.batch)
                gen.rank(0)
        except TPCompileError as exc:
            raise TPCompileError(in_flags(str(exc))) from exc
    show_warnings(caught, debug=ns.debug)
    print(f"captured and sharded in {time.perf_counter() - start:.1f} s", flush=True)
    ids, mask = example_prompts(vocab, ns.batch, length, seed=ns.seed)
    with step(f"generating on {ws} simulated ranks and with the unsharded model"):
        outs = tpcompile.simulate_ranks(ws, lambda r: gen.rank(r).generate(ids, attention_mask=mask,
                                                                            max_new_tokens=new))
        want = reference_generate(model, ids, mask, new)
    stats = gen.rank(0).stats
    for row in range(ns.batch):
        keep = mask[row].bool()
        print(f"prompt {row}: {ids[row][keep].tolist()}")
        print(f"  unsharded: {want[row, length:].tolist()}")
        print(f"  rank 0:    {outs[0][row, length:].tolist()}")
    decode = sum(stats.decode_s) / len(stats.decode_s) if stats.decode_s else 0.0
    print(f"rank 0 (simulated ranks are threads of this process): time to first token {stats.prefill_s * 1e3:.1f} ms, "
          f"{decode * 1e3:.1f} ms per token after it, {stats.tokens_per_s:.1f} tokens/s per row")
    whole = ws > 1 and gen.cache_bytes(0) >= gen.unsharded_cache_bytes
    why = "see the warnings" if caught else "its key/value heads are whole on every rank (one kv head, or kv " \
        "heads `tpcompile plan` lists as replicated)"
    print(f"cache per rank {format_bytes(gen.cache_bytes(0))} of {format_bytes(gen.unsharded_cache_bytes)} "
          f"unsharded" + (f" (not split: every rank holds all of it, {why})" if whole else ""))
    same = [torch.equal(out, want) for out in outs]
    if all(same):
        print(f"OK: all {ws} ranks generated the unsharded model's tokens")
        return 0
    bad = [r for r, ok in enumerate(same) if not ok]
    print(f"MISMATCH: ranks {bad} generated other tokens than the unsharded model")
    return 1


def show_warnings(caught: list, *, debug: bool) -> None:
    """Each TPCompileWarning once, as one 'warning:' line on stderr (in full with --debug); others passed on."""
    shown: set[str] = set()
    for w in caught:
        if not issubclass(w.category, tpcompile.TPCompileWarning):
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
        elif str(w.message) not in shown:
            shown.add(str(w.message))
            note(f"warning: {one_line(str(w.message)) if debug else short_warning(str(w.message))}")


def in_flags(text: str) -> str:
    """shard_generation's message in this command's terms: its flags instead of the Python arguments."""
    text = re.sub(r"\bpass max_seq_len <= (\d+)", r"make --prompt-len + --max-new-tokens at most \1", text)
    text = re.sub(r"\bmax_seq_len=(\d+)", r"--prompt-len + --max-new-tokens = \1", text)
    text = re.sub(r"call shard_generation\(\.\.\., max_batch_size=(\d+)\)", r"pass --batch \1", text)
    return re.sub(r"\bmax_batch_size=(\d+)", r"--batch \1", text)


def vocab_size(model: torch.nn.Module, spec: str) -> int:
    """The vocabulary the prompts draw from: the config's vocab_size, else the token embedding's rows."""
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int):
        return vocab
    for mod in model.modules():
        if isinstance(mod, torch.nn.Embedding):
            return mod.num_embeddings
    raise TPCompileError(f"{spec}: no vocabulary size (config.vocab_size or an Embedding); generate needs a "
                         f"language model")
