"""One way to open the broker's SQLite databases (sessions.db, ledger.db, directory.db, …).

Rules:
- Every database the broker keeps is private to its user: the file is created 0600 before
  SQLite touches it (and an existing one is never opened by a descriptor of ours:
  `create_private`), and the WAL and shared-memory side files are tightened to 0600 as
  well (SQLite copies the main file's mode onto them, but a umask or an older file could
  leave them wider; we do not rely on it).
- WAL journal mode, so a reader (the CLI listing credentials, an audit) never blocks the
  daemon's writer and the writer never blocks readers.
- `synchronous=FULL`: a commit returns only after the WAL is fsynced. The ledger's whole
  promise ("pending is durable BEFORE any side effect") rests on this; the sessions store
  uses it too because a revocation must survive a crash.
- Autocommit at the driver level (`isolation_level=None`): callers open transactions
  themselves, with `transaction` (BEGIN IMMEDIATE … COMMIT), so it is visible where one
  fsync covers many writes; a statement outside one commits alone.
- `check_same_thread=False`: the ledger hands its one connection to trio worker threads,
  one at a time under a CapacityLimiter(1); the limiter, not sqlite3's thread check, is
  what keeps the connection single-user.

WARNING: a database opened here is owned by exactly one object; nothing else may share the
connection.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["open_private_db", "create_private", "transaction", "FILE_MODE", "BUSY_TIMEOUT_MS"]

#: Owner read/write only: these files hold credential hashes and signed pending events.
FILE_MODE = 0o600

#: How long a statement waits for another connection's lock (the CLI writing while the
#: daemon reads) before SQLite reports "database is locked". Writes here are tiny, so a
#: few seconds is generous.
BUSY_TIMEOUT_MS = 5000

_SIDE_FILES = ("-wal", "-shm")


def _tighten(path: Path) -> None:
    for suffix in ("", *_SIDE_FILES):
        p = Path(str(path) + suffix)
        try:
            if p.stat().st_mode & 0o777 != FILE_MODE:
                os.chmod(p, FILE_MODE)
        except FileNotFoundError:
            continue


@contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One write transaction around the block: committed when it ends, rolled back when it
    raises anything, the trio cancellation and KeyboardInterrupt included, and re-raised.

    IMMEDIATE: the write lock is taken at BEGIN, under the busy timeout, so a transaction
    that reads before it writes never fails half-way for another writer's lock.
    The ROLLBACK only while one is open: SQLite ends a transaction by itself on some
    errors (SQLITE_FULL, IOERR), and "no transaction is active" must not replace the
    error that matters; a COMMIT that fails (a deferred constraint, a lock) leaves it
    open, and it is rolled back here.

    Raises:
        ValueError: `conn` is not in driver autocommit (`isolation_level=None`, as
            `open_private_db` opens it): sqlite3 would begin transactions of its own
            before DML, and the block would not be the whole transaction.
    """
    if conn.isolation_level is not None:
        raise ValueError("transaction needs a connection with isolation_level=None")
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def create_private(path: Path) -> None:
    """Create `path` empty with FILE_MODE if it does not exist; never open an existing one.

    With the final mode atomically, so there is no moment at which a freshly created
    database is readable by others. Only with O_EXCL: SQLite's locks are POSIX locks, held
    per process, and closing *any* descriptor of the file drops every one of them (SQLite's
    "How To Corrupt" §2.2). A plain open-and-close here, from a second connection to a
    database this process already had open (the sessions store's last-use writer), left
    the daemon's connection without its read lock: a CLI closing the database then
    checkpointed and deleted the WAL under it, and the daemon went on reading a stale
    index (revocations unseen) and at its stop wrote an old image over the file.
    """
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE))
    except FileExistsError:
        pass


def open_private_db(path: Path, schema: str) -> sqlite3.Connection:
    """Open (creating if needed) a private WAL database and apply `schema`.

    Args:
        path: the database file. Its directory must exist.
        schema: idempotent DDL (`CREATE ... IF NOT EXISTS`), run in one transaction.

    Returns:
        A connection in autocommit mode, WAL, synchronous=FULL.

    Raises:
        ValueError: `path` is a directory (a caller passed the state dir, not the file).
        OSError / sqlite3.Error: the file cannot be created or opened.
    """
    if path.is_dir():
        raise ValueError(f"expected a database file, got a directory: {path}")
    create_private(path)
    conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
    try:
        conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise sqlite3.OperationalError(f"cannot enable WAL on {path} (got {mode})")
        conn.execute("PRAGMA synchronous=FULL")
        with transaction(conn):
            for statement in schema.split(";"):
                if statement.strip():
                    conn.execute(statement)
    except BaseException:
        conn.close()
        raise
    _tighten(path)
    return conn
