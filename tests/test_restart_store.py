"""runtime/restart_store.py: under torchrun's shared store every restart attempt's keys stay apart (no processes)."""
from __future__ import annotations

import logging
from datetime import timedelta

import pytest
import torch.distributed as dist

from tpcompile.runtime.launch import free_port
from tpcompile.runtime.restart_store import restart_store

TIMEOUT = timedelta(seconds=10)


def _torchrun_env(monkeypatch: pytest.MonkeyPatch, port: int, attempt: int, local_world: int = 2) -> None:
    """The variables torchrun gives a worker of a one-node (or several-node) job with restarts."""
    for key, value in {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": str(attempt),
                       "TORCHELASTIC_MAX_RESTARTS": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": str(local_world)}.items():
        monkeypatch.setenv(key, value)


def test_each_attempt_sees_only_its_own_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """A key the failed attempt 0 left in the shared store is not visible to attempt 1, which writes its own."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=TIMEOUT)  # torchrun's agent holds it
    _torchrun_env(monkeypatch, port, 0)
    restart_store(TIMEOUT).set("rank_1_address", "old")
    _torchrun_env(monkeypatch, port, 1)
    again = restart_store(TIMEOUT)
    assert not again.check(["rank_1_address"])
    again.set("rank_1_address", "new")
    assert server.get("tpcompile/attempt_0/rank_1_address") == b"old"
    assert server.get("tpcompile/attempt_1/rank_1_address") == b"new"


def test_plain_launches_and_several_nodes_use_env(monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """No torchrun store: None (env:// as before); several nodes with restarts: None and a warning naming the fix."""
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert restart_store(TIMEOUT) is None
    _torchrun_env(monkeypatch, free_port(), 0, local_world=1)
    with caplog.at_level(logging.WARNING, logger="tpcompile"):
        assert restart_store(TIMEOUT) is None
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in caplog.text
