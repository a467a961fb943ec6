"""daemon/log: the journald priority prefix, only when $JOURNAL_STREAM names our stream."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from daemon.log import PRIORITIES, ROOT_LOGGER, log_event, setup_logging


@pytest.fixture
def restore_logging() -> object:
    root = logging.getLogger(ROOT_LOGGER)
    handlers, level, propagate = list(root.handlers), root.level, root.propagate
    yield None
    root.handlers[:] = handlers
    root.setLevel(level)
    root.propagate = propagate


def _emit(path: Path, environ: dict[str, str]) -> list[str]:
    with open(path, "w", encoding="utf-8") as stream:
        setup_logging("debug", stream=stream, environ=environ)
        log = logging.getLogger(ROOT_LOGGER + ".test")
        log_event(log, "t.debug", level=logging.DEBUG, n=1)
        log_event(log, "t.info", agent="ab" * 32)
        log_event(log, "t.warning", level=logging.WARNING, reason="x")
        log_event(log, "t.error", level=logging.ERROR, code="e")
        log.critical("plain %s", "text")
        stream.flush()
    return path.read_text().splitlines()


def test_journald_stream_gets_the_priority_prefix(tmp_path: Path, restore_logging: object) -> None:
    path = tmp_path / "journal"
    path.touch()
    st = os.stat(path)
    lines = _emit(path, {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
    assert [line[:3] for line in lines] == ["<7>", "<6>", "<4>", "<3>", "<2>"]
    # The JSON after the prefix keeps every field, in order.
    info = json.loads(lines[1][3:])
    assert list(info) == ["time", "level", "logger", "event", "agent"]
    assert (info["level"], info["event"], info["agent"]) == ("info", "t.info", "ab" * 32)
    assert json.loads(lines[2][3:])["reason"] == "x"
    assert json.loads(lines[4][3:])["message"] == "plain text"


@pytest.mark.parametrize("journal", ["", "1:2", None])
def test_no_prefix_elsewhere(tmp_path: Path, restore_logging: object, journal: str | None) -> None:
    """A terminal, a file, a pipe, or a JOURNAL_STREAM inherited for another fd: plain JSON."""
    environ = {} if journal is None else {"JOURNAL_STREAM": journal}
    lines = _emit(tmp_path / "plain", environ)
    assert len(lines) == 5 and all(line.startswith("{") for line in lines)
    assert [json.loads(line)["level"] for line in lines] == [
        "debug", "info", "warning", "error", "critical"]


def test_priorities_cover_every_level() -> None:
    assert [p for _level, p in PRIORITIES] == [2, 3, 4, 6, 7]  # crit, err, warning, info, debug
