"""What a commit by another connection costs the daemon's credential table.

Last use is written off the event loop on a connection of its own (daemon/wiring.py), so
its commit moves the daemon connection's `PRAGMA data_version` as the CLI's commits do.
A reload of the table is 20 ms per thousand credentials on the loop; the `generation`
row, counted up by triggers in the database, tells a last-use write from a credential's
change. Proven here: a last-use write reloads nothing; every insert, delete and update of
any column but last use (the module's own `GENERATION_COLUMNS`, iterated) reloads at the
next request, whoever wrote it; the column list is the table's; an older database gains
the row and its triggers at open.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.state.sessions import GENERATION_COLUMNS, SESSIONS_FILENAME, SessionStore

AGENT = "ab" * 32
CHANNEL = "123e4567-e89b-12d3-a456-426614174000"
NOW = 1_800_000_000


class _Counted(SessionStore):
    reloads = 0

    def reload(self) -> None:
        self.reloads += 1
        super().reload()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[_Counted]:
    s = _Counted.open(tmp_path)
    assert isinstance(s, _Counted)
    yield s
    s.close()


@pytest.fixture
def other(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    """Another writer of the same database (the CLI, an operator's sqlite3)."""
    conn = sqlite3.connect(tmp_path / SESSIONS_FILENAME, isolation_level=None)
    yield conn
    conn.close()


def _issue(store: SessionStore) -> tuple[str, str]:
    return store.issue(agent=AGENT, channels=frozenset({CHANNEL}),
                       actions=frozenset({"channel.read"}), ttl_seconds=None, uid=None,
                       now=NOW)


def _ask(store: SessionStore, token: str) -> bool:
    return store.authenticate(f"Bearer {token}", None, NOW) is not None


def _issued_by_the_cli(path: Path) -> tuple[str, str]:
    cli = SessionStore.open(path)
    try:
        return _issue(cli)
    finally:
        cli.close()


def test_a_last_use_written_elsewhere_reloads_nothing(
    tmp_path: Path, store: _Counted, other: sqlite3.Connection
) -> None:
    cid, token = _issued_by_the_cli(tmp_path)
    assert _ask(store, token)  # the CLI's insert: one reload
    before = store.reloads
    for round_ in range(3):
        noted = store.take_last_use()
        assert noted == {cid: NOW + round_}
        store.write_last_use(noted)  # its own connection, as the worker thread does
        assert _ask(store, token)
        store.authenticate(f"Bearer {token}", None, NOW + round_ + 1)
    assert store.reloads == before
    assert other.execute("SELECT last_used_at FROM credentials").fetchall() == [(NOW + 2,)]


@pytest.mark.parametrize("column", GENERATION_COLUMNS)
def test_an_update_of_any_other_column_reloads_at_the_next_request(
    store: _Counted, other: sqlite3.Connection, column: str
) -> None:
    _, token = _issue(store)
    assert _ask(store, token)
    before = store.reloads
    # The trigger fires for a column named in SET, even when the value stays.
    other.execute(f"UPDATE credentials SET {column} = {column}")
    assert _ask(store, token)
    assert store.reloads == before + 1


def test_a_revocation_right_after_a_last_use_write_holds_at_once(
    store: _Counted, other: sqlite3.Connection
) -> None:
    _, token = _issue(store)
    assert _ask(store, token)
    store.write_last_use(store.take_last_use())
    assert _ask(store, token)  # the write's moved version is taken, nothing reloaded
    other.execute("UPDATE credentials SET revoked_at = ?", (NOW,))
    assert not _ask(store, token)


def test_inserts_and_deletes_reload(tmp_path: Path, store: _Counted,
                                    other: sqlite3.Connection) -> None:
    _, token = _issued_by_the_cli(tmp_path)
    assert _ask(store, token)
    other.execute("DELETE FROM credentials")
    assert not _ask(store, token)


def test_the_generation_covers_every_column_of_the_table(other: sqlite3.Connection,
                                                         store: _Counted) -> None:
    present = {str(row[1]) for row in other.execute("PRAGMA table_info(credentials)")}
    assert present == {*GENERATION_COLUMNS, "last_used_at"}


def test_an_older_database_gains_the_generation_at_open(tmp_path: Path) -> None:
    old = sqlite3.connect(tmp_path / SESSIONS_FILENAME)
    old.executescript("""
        CREATE TABLE credentials (credential_id TEXT PRIMARY KEY, token_sha256 BLOB NOT NULL
          UNIQUE, agent TEXT NOT NULL, channels TEXT NOT NULL, actions TEXT NOT NULL,
          created_at INTEGER NOT NULL, expires_at INTEGER, uid INTEGER, revoked_at INTEGER);
    """)
    old.close()
    store = SessionStore.open(tmp_path)
    again = SessionStore.open(tmp_path)  # a second opener finds it all there
    writer = sqlite3.connect(tmp_path / SESSIONS_FILENAME, isolation_level=None)
    try:
        _, token = _issue(store)
        assert _ask(again, token)
        writer.execute("UPDATE credentials SET revoked_at = ?", (NOW,))
        assert not _ask(again, token)
        triggers = {str(row[0]) for row in writer.execute(
            "SELECT name FROM sqlite_master WHERE type = 'trigger'")}
        assert triggers == {"credentials_inserted", "credentials_deleted",
                            "credentials_changed"}
    finally:
        writer.close()
        again.close()
        store.close()
