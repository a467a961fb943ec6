"""A directory.db of a schema version this build does not know (a newer build's) is refused
by every reader and writer of daemon/state/directory.py, in one line naming both versions,
as the keystore's openers refuse a newer keystore (tests/custody/test_keystore_version.py).

Unchecked, a newer file's names were read as this build's, and the first write here
(a rename, an enroll, the prune at the daemon's start) copied the version-1 names in again
and marked the file version 1: a downgrade the newer build would then misread.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from custody._keystore import Keystore
from custody._records import KeyRecord
from daemon.state.directory import (
    DIRECTORY_FILE,
    SCHEMA_VERSION,
    AgentDirectory,
    DirectoryError,
)

REPO = Path(__file__).resolve().parents[1]
AGENT, OWNER = "b" * 64, "a" * 64
NEWER = SCHEMA_VERSION + 1

#: Each reader and writer, as its first touch of the file.
OPENERS: dict[str, Callable[[AgentDirectory], object]] = {
    "agents": lambda d: d.agents(include_deleted=True),
    "get": lambda d: d.get(AGENT),
    "named": lambda d: d.named(),
    "enroll": lambda d: d.enroll(AGENT, "new"),
    "rename": lambda d: d.rename(AGENT, "new"),
    "prune": lambda d: d.prune(now=10**10),
    "forget": lambda d: d.forget([AGENT]),
}


def _state(state_dir: Path, version: int) -> Path:
    """A keystore holding one live key, and a directory naming it, marked `version`."""
    keystore = Keystore.open(state_dir)
    keystore.insert(KeyRecord(pubkey=AGENT, owner=OWNER, auth_tag=None, created_at=1,
                              deleted_at=None, mint_ref=None), b"sealed", now=1)
    keystore.close()
    directory = AgentDirectory.open(state_dir)
    try:
        assert directory.rename(AGENT, "old") is not None
    finally:
        directory.close()
    db = sqlite3.connect(state_dir / DIRECTORY_FILE)
    db.execute(f"PRAGMA user_version={version}")
    db.close()
    return state_dir / DIRECTORY_FILE


def _refusal(path: Path) -> str:
    return (f"directory {path} has schema version {NEWER}; this build reads up to "
            f"{SCHEMA_VERSION} (a newer build's directory needs that build)")


def _version_and_names(path: Path) -> tuple[int, list[tuple[str, str]]]:
    db = sqlite3.connect(path)
    try:
        return (db.execute("PRAGMA user_version").fetchone()[0],
                db.execute("SELECT pubkey, name FROM names").fetchall())
    finally:
        db.close()


@pytest.mark.parametrize("opener", OPENERS.values(), ids=OPENERS.keys())
def test_every_reader_and_writer_refuses_a_newer_directory_in_one_line(
        opener: Callable[[AgentDirectory], object], tmp_path: Path) -> None:
    path = _state(tmp_path / "state", NEWER)
    directory = AgentDirectory.open(tmp_path / "state")
    try:
        with pytest.raises(DirectoryError) as raised:
            opener(directory)
    finally:
        directory.close()
    assert str(raised.value) == _refusal(path)
    assert _version_and_names(path) == (NEWER, [(AGENT, "old")])  # left as it was


def test_a_known_version_still_reads_and_writes(tmp_path: Path) -> None:
    """The check passes what this build writes (the refusal is not everything)."""
    path = _state(tmp_path / "state", SCHEMA_VERSION)
    directory = AgentDirectory.open(tmp_path / "state")
    try:
        assert [r.name for r in directory.agents()] == ["old"]
        assert directory.rename(AGENT, "new") is not None
    finally:
        directory.close()
    assert _version_and_names(path) == (SCHEMA_VERSION, [(AGENT, "new")])


def test_agent_list_says_it_in_one_line(tmp_path: Path) -> None:
    path = _state(tmp_path / "state", NEWER)
    config = tmp_path / "broker.toml"
    config.write_text(
        f'[server]\nsocket = "{tmp_path / "broker.sock"}"\n[state]\ndir = "{tmp_path / "state"}"\n'
        '[pkcs11]\nmodule = "/nonexistent/libpkcs11.so"\ntoken_label = "none-here"\n'
        '[relay]\nurl = "ws://127.0.0.1:9"\n')
    env = {k: v for k, v in os.environ.items()
           if k not in ("CREDENTIALS_DIRECTORY", "BUZZ_BROKER_CONFIG")}
    done = subprocess.run(
        [sys.executable, "-m", "daemon.cli", "--config", str(config), "agent", "list"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and done.stdout == "", done.stdout
    [line] = done.stderr.splitlines()
    assert _refusal(path) in line, done.stderr
