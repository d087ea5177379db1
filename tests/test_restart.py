"""Crash recovery (pytest -m restart, about a minute): SIGKILL one rank after a save, torchrun restarts the job.

examples/train_hybrid.py runs under `torchrun --max-restarts 1` at (dp, tp, pp) = (1, 2, 1), saving
the whole training state every 4 steps. Once the first checkpoint is complete, the test kills rank 1 with
SIGKILL; torchrun stops rank 0, starts both again, and they resume from the latest complete
checkpoint (a save the kill cut short is skipped). The final report must hold every step's loss,
equal to an uninterrupted single-process run (float64).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from hybrid_matrix import EXAMPLE, ROOT, _port, run_example, worst_relative

pytestmark = [pytest.mark.restart, pytest.mark.gloo]

STEPS, EVERY = 16, 4
ARGS = ["--layers", "2", "--inputs", "8x16:long", "--dtype", "float64", "--steps", str(STEPS), "--json"]


def _worker(launcher: psutil.Process, local_rank: int) -> psutil.Process:
    """The running worker process of torchrun with LOCAL_RANK=local_rank."""
    for child in launcher.children(recursive=True):
        try:
            if child.environ().get("LOCAL_RANK") == str(local_rank):
                return child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    raise AssertionError(f"torchrun has no worker with LOCAL_RANK={local_rank}")


def _kill_after_first_save(proc: subprocess.Popen, ckpt: Path, deadline: float) -> None:
    """SIGKILL rank 1 as soon as the first checkpoint under `ckpt` is complete."""
    first = ckpt / f"step_{EVERY:06d}" / ".complete"
    while not first.exists():
        assert proc.poll() is None, f"torchrun ended before any checkpoint: {proc.communicate()}"
        assert time.monotonic() < deadline, "no checkpoint within the time limit"
        time.sleep(0.02)
    _worker(psutil.Process(proc.pid), 1).send_signal(signal.SIGKILL)


def test_killed_rank_restarts_from_the_latest_checkpoint(tmp_path: Path) -> None:
    """Rank 1 SIGKILLed mid-run: torchrun --max-restarts 1 resumes it, and all 16 losses equal the uninterrupted run."""
    want = run_example(["--dp", "1", "--tp", "1", "--pp", "1", *ARGS])["losses"]
    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
           "--master-port", _port(), str(EXAMPLE), "--dp", "1", "--tp", "2", "--pp", "1", *ARGS,
           "--checkpoint-dir", str(ckpt), "--save-every", str(EVERY), "--keep", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "TPCOMPILE_TIMEOUT_S": "60"}
    deadline = time.monotonic() + 100
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _kill_after_first_save(proc, ckpt, deadline)
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-4000:]
    assert "exitcode  : -9" in err or "exitcode: -9" in err, err[-4000:]  # torchrun saw the kill and restarted
    report = json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])
    assert 0 < report["start_step"] < STEPS, report["start_step"]  # it resumed mid-run, not from the start
    assert report["start_step"] % EVERY == 0 and len(report["losses"]) == STEPS - report["start_step"]
    got = report["all_losses"]
    assert len(got) == STEPS
    assert worst_relative(got, want) < 1e-9, (got, want)
    assert len(os.listdir(ckpt)) <= 3  # --keep 2 (and at most one save the kill cut short)
