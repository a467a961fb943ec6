"""daemon/state/_sqlite.transaction: the one write transaction every store under
daemon/state uses.

Commits when the block ends, rolls back when it raises anything (an Exception, a
KeyboardInterrupt, a trio cancellation) and re-raises that; after it, in either case, the
connection is out of its transaction and holds no write lock another connection waits on.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trio

from daemon.state._sqlite import open_private_db, transaction

_SCHEMA = "CREATE TABLE IF NOT EXISTS t (v INTEGER NOT NULL)"

STATE = Path(__file__).resolve().parent.parent / "daemon" / "state"

#: The transactions under daemon/state still begun by hand, and why each one is not
#: `transaction`'s shape: module -> how many.
HAND_WRITTEN = {
    # The helper itself.
    "_sqlite.py": 1,
    # The group commit's batch: a savepoint per op, an op's failure handed back to its
    # caller as a result, not raised; the batch ends early when SQLite rolled it back.
    "ledger.py": 1,
}


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "t.db"


@pytest.fixture
def conn(path: Path) -> Iterator[sqlite3.Connection]:
    db = open_private_db(path, _SCHEMA)
    yield db
    db.close()


def _rows(path: Path) -> list[int]:
    # Another connection: what is on disk, not what this connection's transaction sees.
    other = sqlite3.connect(str(path))
    try:
        return [v for (v,) in other.execute("SELECT v FROM t ORDER BY v")]
    finally:
        other.close()


def _nothing_left_open(conn: sqlite3.Connection, path: Path) -> None:
    assert not conn.in_transaction
    # No write lock held either: another writer gets one at once, not after a timeout.
    other = sqlite3.connect(str(path), isolation_level=None, timeout=0)
    try:
        other.execute("BEGIN IMMEDIATE")
        other.execute("ROLLBACK")
    finally:
        other.close()


def test_the_block_commits_when_it_ends(conn: sqlite3.Connection, path: Path) -> None:
    with transaction(conn) as db:
        assert db is conn and conn.in_transaction
        db.execute("INSERT INTO t (v) VALUES (1)")
        db.execute("INSERT INTO t (v) VALUES (2)")
        assert _rows(path) == []  # not before the end of the block
    assert _rows(path) == [1, 2]
    _nothing_left_open(conn, path)


class _Boom(Exception):
    pass


def _raise_boom() -> None:
    raise _Boom


def _interrupt() -> None:
    raise KeyboardInterrupt


@pytest.mark.parametrize(("raises", "kind"), [
    (_raise_boom, _Boom),
    (_interrupt, KeyboardInterrupt),
])
def test_the_block_is_rolled_back_on_anything_it_raises(
    conn: sqlite3.Connection, path: Path, raises: Callable[[], None],
    kind: type[BaseException],
) -> None:
    with transaction(conn):
        conn.execute("INSERT INTO t (v) VALUES (0)")
    with pytest.raises(kind):
        with transaction(conn):
            conn.execute("INSERT INTO t (v) VALUES (1)")
            raises()
    assert _rows(path) == [0]
    _nothing_left_open(conn, path)


async def test_a_cancellation_inside_the_block_rolls_it_back(
    conn: sqlite3.Connection, path: Path,
) -> None:
    with trio.CancelScope() as scope:
        with transaction(conn):
            conn.execute("INSERT INTO t (v) VALUES (1)")
            scope.cancel()
            await trio.lowlevel.checkpoint()  # trio.Cancelled, a BaseException, here
    assert scope.cancelled_caught
    assert _rows(path) == []
    _nothing_left_open(conn, path)


def test_a_failed_commit_is_rolled_back_and_raised(tmp_path: Path) -> None:
    # A deferred foreign key fails at COMMIT and leaves the transaction open (SQLite's
    # documented behaviour): the helper must not leave it so.
    path = tmp_path / "fk.db"
    db = open_private_db(path, "CREATE TABLE IF NOT EXISTS p (id INTEGER PRIMARY KEY);"
                               "CREATE TABLE IF NOT EXISTS c (p INTEGER REFERENCES p (id)"
                               " DEFERRABLE INITIALLY DEFERRED)")
    try:
        db.execute("PRAGMA foreign_keys=ON")
        with pytest.raises(sqlite3.IntegrityError):
            with transaction(db):
                db.execute("INSERT INTO c (p) VALUES (7)")
        assert not db.in_transaction
        other = sqlite3.connect(str(path))
        try:
            assert other.execute("SELECT count(*) FROM c").fetchone() == (0,)
        finally:
            other.close()
    finally:
        db.close()


def test_the_blocks_own_error_survives_a_transaction_sqlite_already_ended(
    conn: sqlite3.Connection, path: Path,
) -> None:
    # SQLite rolls a whole transaction back by itself on some errors (SQLITE_FULL, IOERR):
    # a ROLLBACK then would raise "no transaction is active" over the error that matters.
    with pytest.raises(_Boom):
        with transaction(conn):
            conn.execute("INSERT INTO t (v) VALUES (1)")
            conn.execute("ROLLBACK")
            raise _Boom
    assert _rows(path) == []
    _nothing_left_open(conn, path)


def test_only_a_connection_in_driver_autocommit(path: Path) -> None:
    # With the driver's own transaction handling (its default isolation_level), sqlite3
    # opens a transaction before a DML statement by itself: the block would not be the
    # whole transaction. The stores' connections come from open_private_db (None).
    open_private_db(path, _SCHEMA).close()
    legacy = sqlite3.connect(str(path))
    try:
        with pytest.raises(ValueError, match="isolation_level"):
            with transaction(legacy):
                pass
        assert not legacy.in_transaction
    finally:
        legacy.close()


def test_no_store_begins_a_transaction_by_hand() -> None:
    # A BEGIN/COMMIT/ROLLBACK written out again drifts from this one (it did: some
    # copies rolled back after SQLite had already, some committed outside their try).
    begun = {path.name: n for path in sorted(STATE.glob("*.py"))
             if (n := len(re.findall(r"""execute\(\s*["']BEGIN""", path.read_text())))}
    assert begun == HAND_WRITTEN
