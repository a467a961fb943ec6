"""A keystore of a schema version this build does not know (a newer build's) is refused by
every opener, in one message: the writer (`Keystore.open`), custody's reader (`ReadIndex`),
the daemon's (`KeyIndex`) and `read_meta`, and so `agent list` and `status` as one line.

Read through a table it does not know as "no such table, no rows", a newer build's file
listed no agents with exit 0, `status` said 0 live and `credential issue` said no such
agent (custody/_keystore.py, "Schema versions").
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from custody import CustodyError, KeyIndex
from custody._keystore import KEYSTORE_FILE, SCHEMA_VERSION, Keystore, ReadIndex, read_meta
from custody._records import KeyRecord

REPO = Path(__file__).resolve().parents[2]
AGENT, OWNER = "b" * 64, "a" * 64
NEWER = SCHEMA_VERSION + 1
#: Each opener, and the read that first touches the file.
READERS: dict[str, Callable[[Path], object]] = {
    "Keystore.open": Keystore.open,
    "ReadIndex.all": lambda state: ReadIndex(state / KEYSTORE_FILE).all(),
    "ReadIndex.version": lambda state: ReadIndex(state / KEYSTORE_FILE).version(),
    "KeyIndex.get": lambda state: KeyIndex.open(state).get(AGENT),
    "KeyIndex.v1_names": lambda state: KeyIndex.open(state).v1_names(),
    "read_meta": read_meta,
}


def _newer_keystore(state_dir: Path) -> Path:
    """A keystore holding one key, then marked as a newer build would mark its own."""
    keystore = Keystore.open(state_dir)
    keystore.insert(KeyRecord(pubkey=AGENT, owner=OWNER, auth_tag=None, created_at=1,
                              deleted_at=None, mint_ref=None), b"sealed", now=1)
    keystore.close()
    db = sqlite3.connect(state_dir / KEYSTORE_FILE)
    db.execute(f"PRAGMA user_version={NEWER}")
    db.close()
    return state_dir / KEYSTORE_FILE


def _refusal(path: Path) -> str:
    return (f"keystore {path} has schema version {NEWER}; this build reads up to "
            f"{SCHEMA_VERSION} (a newer build's keystore needs that build)")


@pytest.mark.parametrize("reader", READERS.values(), ids=READERS.keys())
def test_every_opener_refuses_a_newer_keystore_in_one_message(
        reader: Callable[[Path], object], tmp_path: Path) -> None:
    path = _newer_keystore(tmp_path / "state")
    with pytest.raises(CustodyError) as raised:
        reader(tmp_path / "state")
    assert str(raised.value) == _refusal(path)


def test_a_known_version_still_reads(tmp_path: Path) -> None:
    """The readers' check passes what this build writes (the refusal is not everything)."""
    _newer_keystore(tmp_path / "state")
    db = sqlite3.connect(tmp_path / "state" / KEYSTORE_FILE)
    db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    db.close()
    index = KeyIndex.open(tmp_path / "state")
    try:
        assert [r.pubkey for r in index.all()] == [AGENT]
    finally:
        index.close()


#: command -> the stdout line that must say the refusal (None: stderr is that one line)
COMMANDS = {"agent list": None, "status": "agents:"}


@pytest.mark.parametrize("command", COMMANDS)
def test_agent_list_and_status_say_it_in_one_line(command: str, tmp_path: Path) -> None:
    path = _newer_keystore(tmp_path / "state")
    config = tmp_path / "broker.toml"
    config.write_text(
        f'[server]\nsocket = "{tmp_path / "broker.sock"}"\n[state]\ndir = "{tmp_path / "state"}"\n'
        '[pkcs11]\nmodule = "/nonexistent/libpkcs11.so"\ntoken_label = "none-here"\n'
        '[relay]\nurl = "ws://127.0.0.1:9"\n')
    env = {k: v for k, v in os.environ.items()
           if k not in ("CREDENTIALS_DIRECTORY", "BUZZ_BROKER_CONFIG")}
    done = subprocess.run(
        [sys.executable, "-m", "daemon.cli", "--config", str(config), *command.split()],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    fact = COMMANDS[command]
    if fact is None:
        [line] = done.stderr.splitlines()
        assert _refusal(path) in line and done.stdout == "", done.stderr
    else:
        [line] = [x for x in done.stdout.splitlines() if x.startswith(fact)]
        assert "FAILED" in line and _refusal(path) in line, done.stdout
