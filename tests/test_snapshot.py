"""bench/snapshot.py, the check that a refactor of the passes is behaviour-preserving: a run writes each case's
decision, parameter cuts and rank graphs."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _snapshot(out: Path) -> dict[str, str]:
    # a process of its own: the plugin patches ShardedModel for the whole process
    subprocess.run([sys.executable, str(ROOT / "bench" / "snapshot.py"), str(out), "--only", "llama", "--parts", "8"],
                   cwd=ROOT, check=True, capture_output=True, timeout=600)
    return {p.name: p.read_text() for p in sorted(out.iterdir())}


def test_a_run_writes_each_cases_decision_and_rank_graphs(tmp_path: Path) -> None:
    first = _snapshot(tmp_path / "a")
    assert list(first) == ["hf_llama_default_ws2.txt"]  # every 8th case: llama's first
    text = first["hf_llama_default_ws2.txt"]
    for part in ("=== sm 1 LlamaForCausalLM ws 2", "cut model.layers.0.self_attn.q_proj.weight: dim 0 64:0,32,64",
                 "=== sm 1 rank 0\n", "=== sm 1 rank 1\n", "all_reduce"):
        assert part in text, part
