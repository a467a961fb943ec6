"""`read_credential_file` refuses what is not a regular file, at once: a FIFO put where the
credential file goes would otherwise block the agent's first call for ever."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from buzz_broker_client import NotConfigured
from buzz_broker_client._env import read_credential_file


def _read(path: Path) -> object:
    """What `read_credential_file(path)` returned or raised; a call that blocks fails the
    test instead of hanging it (a writer's open releases it)."""
    outcome: list[object] = []

    def read() -> None:
        try:
            outcome.append(read_credential_file(str(path)))
        except Exception as exc:  # noqa: BLE001 - the test looks at what it was
            outcome.append(exc)

    worker = threading.Thread(target=read, daemon=True)
    worker.start()
    worker.join(10)
    if worker.is_alive():
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(10)
        pytest.fail(f"read_credential_file waited on {path}")
    return outcome[0]


def test_a_fifo_is_refused_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "credential"
    os.mkfifo(fifo)
    refused = _read(fifo)
    assert isinstance(refused, NotConfigured), refused
    assert f"credential file {fifo} is not a regular file" in str(refused)


def test_a_directory_is_refused(tmp_path: Path) -> None:
    refused = _read(tmp_path)
    assert isinstance(refused, NotConfigured), refused
    assert f"credential file {tmp_path}" in str(refused)


def test_a_regular_file_is_read(tmp_path: Path) -> None:
    path = tmp_path / "credential"
    path.write_text("bb1.a-credential\n")
    path.chmod(0o400)
    read = read_credential_file(str(path))
    assert (read.value, read.loose_mode) == ("bb1.a-credential", None)
