"""A dead or stalled peer: the surviving rank raises a TPCompileError naming the collective, and exits cleanly.

Each scenario is a 2-rank gloo group running the bundled GPT's rank graphs with
TPCOMPILE_TIMEOUT_S=3. Rank 1 dies (SIGKILL, os._exit) or stalls at one of its collectives and
rank 0 reports what it raised. One rank-0 process serves every scenario in turn, a fresh group
each, and its exit code is checked too; the rank-1 processes start at once (starting processes is
the slow part). The spawn loop is the test's own: a dying rank is the point here, which
tpcompile.runtime.launch reports as a failure.
"""
from __future__ import annotations

import os
import queue as queue_mod
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from tpcompile import TPCompileError
from tpcompile.runtime import free_port
from tpcompile.runtime.failures import translate

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 3
STALL_S = 10  # well past TIMEOUT_S plus the roll call, so rank 0 fails first
SCENARIOS = ("killed_forward", "killed_backward", "stalled_forward")  # the stall last: it takes longest


def _sabotage(scenario: str) -> None:
    """Make this process (rank 1) die or stall at the collective the scenario names."""
    import torch.distributed as dist

    real, calls = dist.all_reduce, [0]

    def all_reduce(tensor: torch.Tensor, *args: object, **kwargs: object) -> object:
        # torch.distributed's own all_reduce, which every tpcompile all-reduce (plain or in place) ends in
        in_backward = torch._C._current_graph_task_id() >= 0
        calls[0] += 1
        if scenario == "killed_forward" and calls[0] == 2:  # after the first collective, before the second
            os.kill(os.getpid(), signal.SIGKILL)
        if scenario == "stalled_forward" and calls[0] == 2:
            time.sleep(STALL_S)
            os._exit(0)
        if scenario == "killed_backward" and in_backward:
            os._exit(1)
        return real(tensor, *args, **kwargs)

    dist.all_reduce = all_reduce


def _join(port: int) -> None:
    """Join a fresh 2-rank group from torchrun's variables, as init_from_env does under torchrun."""
    from tpcompile.runtime import init_from_env

    os.environ["MASTER_PORT"] = str(port)
    init_from_env()


def _model(rank: int) -> tuple[torch.fx.GraphModule, torch.Tensor]:
    """This rank's graph of the bundled GPT at world size 2, and an input batch."""
    import tpcompile
    from tpcompile.models import build

    torch.manual_seed(0)
    return tpcompile.shard(build("gpt"), 2).rank(rank), torch.randint(0, 256, (2, 16))


def _step(gm: torch.fx.GraphModule, idx: torch.Tensor, scenario: str) -> tuple:
    """Forward (and backward): ('no error', ...) or (exception type, message, seconds, type of its cause)."""
    start = time.monotonic()
    try:
        out = gm(idx)
        if scenario == "killed_backward":
            out.float().sum().backward()
        return ("no error", "", 0.0, "")
    except Exception as e:  # noqa: BLE001  the test inspects what was raised
        return (type(e).__name__, str(e), time.monotonic() - start, type(e.__cause__).__name__)


def _environment() -> None:
    """torchrun's variables for a 2-rank group on this machine, with the short timeout."""
    os.environ.update(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", TPCOMPILE_TIMEOUT_S=str(TIMEOUT_S))
    torch.set_num_threads(1)


def _survivor(ports: dict[str, int], ready: dict[str, Any], go: dict[str, Any], results: Any) -> None:
    """Rank 0 of every scenario in turn, each in a fresh group: run, report, leave the group with shutdown()."""
    _environment()
    os.environ.update(RANK="0", LOCAL_RANK="0")
    from tpcompile.runtime import shutdown

    gm, idx = _model(0)
    for scenario in SCENARIOS:
        # join once the peer has built its graph, so the rendezvous never waits out the short timeout
        if not ready[scenario].wait(timeout=180):
            results.put((scenario, ("peer never ready", "", 0.0, "")))
            return
        go[scenario].set()
        _join(ports[scenario])
        results.put((scenario, _step(gm, idx, scenario)))
        if scenario != SCENARIOS[-1]:
            try:  # its barrier fails (the peer is gone), and the group is destroyed all the same
                shutdown()
                results.put((f"{scenario}/shutdown", "no error"))
            except TPCompileError as e:
                results.put((f"{scenario}/shutdown", str(e)))
    # the last group is left broken and initialised: interpreter exit must neither hang nor abort


def _peer(scenario: str, port: int, ready: Any, go: Any) -> None:
    """Rank 1 of one scenario: die or stall where the scenario says."""
    _environment()
    os.environ.update(RANK="1", LOCAL_RANK="1")
    gm, idx = _model(1)
    ready.set()
    if go.wait(timeout=240):  # rank 0 is serving the scenarios before this one meanwhile
        _join(port)
        _sabotage(scenario)
        _step(gm, idx, scenario)


@pytest.fixture(scope="module")
def outcomes() -> dict[str, Any]:
    """Rank 0's outcome per scenario and its exit code; the peers start at once (starting is the slow part)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ports = {s: free_port() for s in SCENARIOS}
    ready, go = ({s: ctx.Event() for s in SCENARIOS} for _ in range(2))
    survivor = ctx.Process(target=_survivor, args=(ports, ready, go, results), name="rank0")
    peers = [ctx.Process(target=_peer, args=(s, ports[s], ready[s], go[s]), name=f"{s}-rank1") for s in SCENARIOS]
    got: dict[str, Any] = {}
    deadline = time.monotonic() + 240
    try:
        for p in [survivor, *peers]:
            p.start()
        while len(got) < 2 * len(SCENARIOS) - 1 and time.monotonic() < deadline and survivor.exitcode is None:
            try:
                scenario, outcome = results.get(timeout=1.0)
            except queue_mod.Empty:
                continue
            got[scenario] = outcome
        survivor.join(timeout=max(1.0, min(60.0, deadline - time.monotonic())))
        got["exitcode"] = survivor.exitcode
    finally:
        for p in [survivor, *peers]:
            if p.pid is not None:  # started
                p.kill()
                p.join(timeout=10)
    return got


def _rank0(outcomes: dict[str, Any], scenario: str) -> tuple[str, float]:
    """Rank 0's TPCompileError message and seconds to it; fails unless that is what it raised and it exited 0."""
    assert scenario in outcomes, f"{scenario}: rank 0 reported nothing (exit code {outcomes.get('exitcode')})"
    kind, message, seconds, cause = outcomes[scenario]
    assert kind == "TPCompileError", f"{scenario}: rank 0 raised {kind}: {message}"
    assert cause == "RuntimeError", f"{scenario}: torch's error is not chained: {cause}"
    assert seconds < 30, f"{scenario}: {seconds:.1f} s to the error"
    return message, seconds


@pytest.mark.gloo
def test_peer_killed_mid_forward_names_op_module_shape_and_rank(outcomes: dict) -> None:
    """Rank 1 SIGKILLed before its second all-reduce: rank 0 names tpcompile.all_reduce, module, shape, rank 1."""
    message, _ = _rank0(outcomes, "killed_forward")
    assert re.search(r"tpcompile\.all_reduce(\.inplace)? \(forward\) at transformer\.h\.0\.attn\.c_proj", message), message
    assert "(2, 16, 64) torch.float32" in message, message
    assert "Rank 1 stopped answering" in message and "read rank 1's log first" in message, message
    assert f"TPCOMPILE_TIMEOUT_S = {TIMEOUT_S} s" in message, message


@pytest.mark.gloo
def test_stalled_peer_fails_at_the_timeout(outcomes: dict) -> None:
    """Rank 1 asleep past TPCOMPILE_TIMEOUT_S=3: rank 0 says the peer did not answer in time and names the timeout."""
    message, seconds = _rank0(outcomes, "stalled_forward")
    assert "did not answer within the group's timeout" in message, message
    assert f"TPCOMPILE_TIMEOUT_S = {TIMEOUT_S} s" in message and "at transformer.h.0.attn.c_proj" in message, message
    assert "Rank 1 stopped answering" in message, message
    assert seconds >= TIMEOUT_S - 0.5, f"failed after {seconds:.1f} s, before the timeout"


@pytest.mark.gloo
def test_survivor_exits_cleanly_with_the_broken_group(outcomes: dict) -> None:
    """shutdown() after a peer died raises in words and destroys the group; rank 0 exits 0 with its last, broken
    group still initialised: no hang, no abort."""
    assert len(outcomes) == 2 * len(SCENARIOS), outcomes
    assert outcomes["exitcode"] == 0, f"rank 0 exited {outcomes['exitcode']}"
    for scenario in SCENARIOS[:-1]:  # shutdown() after the failure: its barrier fails in words, the group goes
        told = outcomes[f"{scenario}/shutdown"]
        assert told.startswith("the final barrier of tpcompile.runtime.shutdown()") and "rank 1" in told, told


@pytest.mark.gloo
def test_peer_killed_in_backward_names_backward(outcomes: dict) -> None:
    """Rank 1 exits at its first backward collective: rank 0's error says backward and names the op."""
    message, _ = _rank0(outcomes, "killed_backward")
    assert "all_reduce in backward of tpcompile.grad_all_reduce" in message, message
    assert "Rank 1 stopped answering" in message, message


def test_translate_names_where_and_timeout_and_keeps_tpcompile_errors() -> None:
    """translate() words torch's error with the caller's `where` and the timeout; a TPCompileError passes as is."""
    os.environ["TPCOMPILE_TIMEOUT_S"] = "7"
    try:
        err = translate(RuntimeError("[../gloo/pair.cc:1] Timed out waiting 7000ms for recv operation"),
                        where="pipeline send/recv of stage 1", tensor=torch.zeros(2, 3))
    finally:
        del os.environ["TPCOMPILE_TIMEOUT_S"]
    assert isinstance(err, TPCompileError)
    text = str(err)
    assert text.startswith("pipeline send/recv of stage 1 on a (2, 3) torch.float32 tensor"), text
    assert "Timed out waiting 7000ms" in text and "TPCOMPILE_TIMEOUT_S = 7 s" in text, text
    same = TPCompileError("already told")
    assert translate(same, where="x") is same


def test_shutdown_frees_the_group_and_its_threads() -> None:
    """After shutdown() the WORLD group is freed and no gloo thread is left, though torch.distributed.nn came late."""
    script = textwrap.dedent("""
        import os, weakref, torch, torch.distributed as dist
        import tpcompile
        from tpcompile.runtime import init_from_env, shutdown
        init_from_env(standalone=True)
        import torch.distributed.nn  # what torch.export imports while tpcompile captures, after the group exists
        x = torch.ones(4)
        dist.all_reduce(x)
        group = weakref.ref(dist.group.WORLD)
        shutdown()
        tasks = "/proc/self/task"
        names = [open(f"{tasks}/{t}/comm").read().strip() for t in os.listdir(tasks)] if os.path.isdir(tasks) else []
        print(group() is None, sorted(n for n in names if "gloo" in n))
    """)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd="/",
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "True []", done.stdout


@pytest.mark.slow
def test_generate_example_under_torchrun_exits_cleanly_20_times() -> None:
    """torchrun --nproc-per-node 2 examples/generate.py, 20 runs in a row: every one exits 0 (no abort at teardown)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    codes = []
    for _ in range(20):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), str(ROOT / "examples" / "generate.py"), "--tokens", "4"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
        codes.append(done.returncode)
        assert done.returncode == 0, f"run {len(codes)}: exit {done.returncode}\n{done.stderr[-3000:]}"
        assert "OK (same tokens" in done.stdout, done.stdout[-2000:]
    assert codes == [0] * 20
