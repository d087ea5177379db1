"""Snapshot what tpcompile decides and emits for the Hugging Face architectures, to check that a refactor of the
passes is behaviour-preserving (the plugin bench/snapshot_plugin.py does the same for the test suite).

Run from the repository root:

    python bench/snapshot.py /tmp/before [--only llama] [--part 0 --parts 2]
    (change the code)
    python bench/snapshot.py /tmp/after
    diff -r /tmp/before /tmp/after

Each architecture of tests/hf_models.py at its default sizes (2 and 4 ranks), with the counts of
bench/uneven_table.py (3, 5, 6 and 8 ranks), and with 8 heads on 2 kv heads (4 and 8 ranks): one file per case with
the decision, every parameter's cut and local shape, every rank's graph code and the warnings. torch.export may
order some independent nodes differently from one process to the next (Gemma-3's two rotary embeddings): rerun
the "before" side to tell that from a change.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import tpcompile  # noqa: E402
from bench import snapshot_plugin  # noqa: E402
from bench.uneven_table import COUNTS, OVERRIDES  # noqa: E402
from hf_models import ALL_ARCHS, build, inputs  # noqa: E402


def cases() -> list[tuple]:
    """(architecture, tag, config, world size) of every case, in a fixed order."""
    out = []
    for arch in ALL_ARCHS:
        out += [(arch, "default", {}, ws) for ws in (2, 4)]
        out += [(arch, "uneven", {**COUNTS, **OVERRIDES.get(arch.name, {})}, ws) for ws in (3, 5, 6, 8)]
        out += [(arch, "kv2", dict(num_attention_heads=8, num_key_value_heads=2, hidden_size=64), ws) for ws in (4, 8)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the folder to write one file per case into")
    parser.add_argument("--only", help="one architecture (its name in tests/hf_models.py)")
    parser.add_argument("--part", type=int, default=0, help="run every --parts-th case from this one")
    parser.add_argument("--parts", type=int, default=1)
    ns = parser.parse_args()
    os.environ["SNAPSHOT_DIR"] = snapshot_plugin._DIR = ns.out
    torch.set_num_threads(1)
    for i, (arch, tag, config, ws) in enumerate(cases()):
        if i % ns.parts != ns.part or ns.only and arch.name != ns.only:
            continue
        os.environ["PYTEST_CURRENT_TEST"] = f"hf_{arch.name}_{tag}_ws{ws} (call)"
        try:
            model = build(arch, **config)
            torch.manual_seed(1)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                sm = tpcompile.shard(model, ws, example_kwargs=inputs(arch, 2, 8))
                for r in range(ws):
                    sm.rank(r)
            said = sorted(str(w.message) for w in caught if issubclass(w.category, tpcompile.TPCompileWarning))
            snapshot_plugin._write("\n".join(f"warning {w}" for w in said))
        except Exception as e:  # a case that fails is a snapshot too
            snapshot_plugin._write(f"error {type(e).__name__}: {str(e)[:3000]}")
        print(f"{i} {arch.name} {tag} ws {ws}", flush=True)


if __name__ == "__main__":
    main()
