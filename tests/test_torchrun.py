"""The training example under the real torchrun launcher (gloo, 2 processes) matches one process."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tpcompile.runtime import free_port

ROOT = Path(__file__).resolve().parent.parent
STEPS = 10


def _example(name: str):
    """Import examples/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.gloo
def test_torchrun_training_matches_single_process() -> None:
    """torchrun --nproc-per-node 2 examples/train_gpt.py --json: losses within 1e-5 of unsharded training."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), str(ROOT / "examples" / "train_gpt.py"),
           "--steps", str(STEPS), "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert (report["world_size"], report["backend"]) == (2, "gloo")
    want = _example("train_gpt").reference_losses(STEPS)
    assert len(report["losses"]) == STEPS
    assert report["losses"][-1] < report["losses"][0] - 0.3  # it learns
    for step, (got, ref) in enumerate(zip(report["losses"], want)):
        assert abs(got - ref) <= 1e-5, f"step {step}: torchrun {got}, one process {ref}"
