"""The "tpcompile" logger: the rank on every record, TPCOMPILE_LOG, and the command line's -v."""
from __future__ import annotations

import logging
import os
from datetime import timedelta

import pytest
import torch.distributed as dist

from tpcompile import logs
from tpcompile.cli.main import build_parser, main
from tpcompile.runtime.launch import free_port


class _Keep(logging.Handler):
    """Keeps every record it is given."""

    def __init__(self) -> None:
        """No records yet."""
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        """Keep the record."""
        self.records.append(record)


def _logged(monkeypatch: pytest.MonkeyPatch) -> logging.LogRecord:
    """One info record of the tpcompile logger, as a handler sees it."""
    keep = _Keep()
    logger = logging.getLogger(logs.LOGGER)
    # setLevel clears the logger's isEnabledFor cache (assigning .level does not); another test may have
    # disabled the logger or logging as a whole, so both are opened for this record and restored after.
    level, disabled, manager_disable = logger.level, logger.disabled, logging.root.manager.disable
    logger.setLevel(logging.INFO)
    logger.disabled = False
    logging.disable(logging.NOTSET)
    logger.addHandler(keep)
    try:
        logger.info("hello")
    finally:
        logger.removeHandler(keep)
        logger.setLevel(level)
        logger.disabled = disabled
        logging.disable(manager_disable)
    return keep.records[-1]


def test_records_carry_the_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside a group the rank is torchrun's RANK (or '-'); inside one it is the group's rank."""
    monkeypatch.delenv("RANK", raising=False)
    assert _logged(monkeypatch).rank == "-"
    monkeypatch.setenv("RANK", "3")
    assert _logged(monkeypatch).rank == "3"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    try:
        record = _logged(monkeypatch)
        assert (record.rank, record.world) == ("0", "1")
    finally:
        dist.destroy_process_group()


def test_level_names() -> None:
    """Level names in any case and numbers read; other words do not."""
    assert [logs.parse_level(t) for t in ("info", "DEBUG", " warning ", "15", "loud")] == [20, 10, 30, 15, None]


def test_tpcompile_log_prints_lines_with_their_rank(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """TPCOMPILE_LOG=info, as read at import: the logger's info lines on stderr as '[rank 1] INFO tpcompile: ...'."""
    logger = logging.getLogger(logs.LOGGER)
    monkeypatch.setattr(logger, "level", logger.level)  # restored after the test, as are its handlers below
    before = list(logger.handlers)
    monkeypatch.setenv("TPCOMPILE_LOG", "info")
    monkeypatch.setenv("RANK", "1")
    logs._install()
    try:
        logger.info("ready")
        logger.debug("not shown")
    finally:
        for h in logger.handlers[len(before):]:
            logger.removeHandler(h)
    err = capsys.readouterr().err
    assert "[rank 1] INFO tpcompile: ready" in err and "not shown" not in err, err


def test_unknown_level_is_a_warning_naming_the_levels(monkeypatch: pytest.MonkeyPatch) -> None:
    """A TPCOMPILE_LOG that names no level warns with the levels to use, and adds no handler."""
    from tpcompile.errors import TPCompileWarning
    monkeypatch.setenv("TPCOMPILE_LOG", "loud")
    before = list(logging.getLogger(logs.LOGGER).handlers)
    with pytest.warns(TPCompileWarning, match="TPCOMPILE_LOG='loud' names no logging level; use one of debug, info"):
        logs._install()
    assert logging.getLogger(logs.LOGGER).handlers == before


def test_cli_verbose_shows_tpcompile_lines(capsys: pytest.CaptureFixture[str]) -> None:
    """-v before or after the subcommand shows tpcompile's info lines with the rank; without it none show."""
    assert build_parser().parse_args(["-v", "plan", "mlp"]).verbose == 1
    assert build_parser().parse_args(["--debug", "plan", "mlp"]).debug is True
    assert main(["plan", "mlp", "-v"]) == 0
    assert "[rank -] INFO tpcompile: capturing MLPStack with torch.export" in capsys.readouterr().err
    assert main(["plan", "mlp"]) == 0
    assert "INFO tpcompile" not in capsys.readouterr().err
    assert os.environ.get("TPCOMPILE_LOG") is None  # -v set it for the command's own rank processes only
