"""The torchrun example runs under the real launcher on gloo."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tpcompile.runtime import free_port

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.gloo
def test_torchrun_example_matches_unsharded() -> None:
    """torchrun --nproc_per_node 2 examples/torchrun_gpt.py prints OK with a tiny difference."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()), str(ROOT / "examples" / "torchrun_gpt.py")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "OK"
    assert "world size 2 on gloo" in lines[-2]
    assert float(lines[-2].rsplit("max |diff| ", 1)[1]) <= 1e-5
