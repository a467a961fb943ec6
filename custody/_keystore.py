"""The keystore: one SQLite table of keys, each an agent's sealed key and custody's few
public facts about it (owner, NIP-OA tag, mint reference, when made and destroyed).

Custody holds secrets and nothing else: an agent's name, who created it and its depth are
the daemon's public directory (daemon/state/directory.py, its own file), never here.

Rules:
- `<state_dir>/keystore.db`; the directory is made 0700 (tightened if looser), the file
  0600 before SQLite first opens it (SQLite gives its -wal/-shm files the same mode).
- WAL journal and `synchronous=FULL`: a key reported minted must survive a power cut.
- A row is written whole in one transaction, or not at all (nothing half-written).
- Destroy keeps the row as a tombstone: `sealed` becomes NULL and `deleted_at` is set, in
  one statement. The table's CHECKs hold that invariant and owner != agent.
- Nothing is loaded at open: every lookup is one indexed query, so opening costs the same
  with ten or ten thousand agents, and rows written by another process (the CLI while the
  daemon runs) are seen at once.
- The token worker's connection (blob reads, writes) is serialized by its own lock. The
  public reads (`Custody.agent`, `agents`, `records_version`) go through a second,
  read-only connection with its own lock (`ReadIndex`): WAL readers never wait for the
  writer, so a liveness check on the event loop never waits behind a mint's fsync or a
  destroy's checkpoint in the worker.
- `ReadIndex` reads the public columns (never `sealed`) read-only, without the token and
  creating nothing. The daemon's directory and `agent list` read key facts through its
  subclass `custody.KeyIndex` (custody/_keyindex.py: also a version-1 file not yet
  upgraded, and its set-aside names), which the custodian never loads.
  `read_meta` reads `custody_meta` the same way.
- Two more tables, both public and written only by custody: `custody_meta` (name -> value:
  the active token and KEK after a rotation or migration, and a rotation's plan and
  retiring KEK while one is under way) and `reseal` (a rotation's staged blobs: new
  ciphertext, swapped in by `_rotation.Staging.swap` in ONE transaction with the meta, or
  discarded).

Schema versions (`PRAGMA user_version`):
  1: table `agents` also held each agent's name, creator and depth.
  2: table `keys` holds only what custody needs. Opening a version-1 file read-write
     upgrades it in ONE transaction: the key columns are copied into `keys`, the names
     and creators into `v1_names` (public, frozen: custody never reads or writes it
     again; the directory reads it for agents it has no name of its own for), and
     `agents` is dropped (secure_delete zeroes its freed pages). Depth is not kept: the
     directory derives it from the owner chain.
  Any other version (a newer build's) is refused by the writer and every reader alike, in
  one message (`_readable_version`): read as if empty, it would list no keys.

Destroying a key, and what is beyond reach:
- `PRAGMA secure_delete=ON` at open: SQLite zeroes the bytes of deleted or shrunk content
  in a page (a destroyed row's old blob) instead of leaving them in the page's free space
  or on the freelist.
- After the tombstone commits, `PRAGMA wal_checkpoint(TRUNCATE)` copies the zeroed page
  into keystore.db and truncates keystore.db-wal to zero bytes, so the WAL frames that
  still held the blob (from its insert and earlier writes) are gone from the files. A
  reader in the middle of a read (another process's directory reader, the sqlite3 shell)
  makes the checkpoint wait up to CHECKPOINT_BUSY_MS and then report busy: that is logged
  (warning) and the WAL is truncated by the next destroy or checkpoint instead. The
  destroy itself has committed either way.
- Beyond reach of any process: blocks the filesystem freed when the WAL was truncated or
  a page rewritten (copy-on-write filesystems, journaling, snapshots, backups) and flash
  cells an SSD's wear levelling remapped. A sealed blob is still ciphertext under a KEK
  that never leaves the token; for a key that must be unrecoverable, destroy it and keep
  the state directory on storage you can discard (or rotate the KEK).
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Self, TypeAlias

from custody._errors import CustodyError
from custody._records import KeyRecord

__all__ = ["KeyRecord", "ReadIndex", "Keystore", "KEYSTORE_FILE", "read_meta"]

log = logging.getLogger("buzz_broker.custody")

#: One SQLite row: its column types are the table's, which the driver does not type.
Row: TypeAlias = tuple[Any, ...]

KEYSTORE_FILE = "keystore.db"
#: How long a write waits for another process's write (the CLI while the daemon runs).
BUSY_TIMEOUT_MS = 5000
#: How long the post-destroy checkpoint waits for readers: it holds the token worker, and a
#: blocked checkpoint only delays the WAL's truncation to the next one (module docstring).
CHECKPOINT_BUSY_MS = 500
SCHEMA_VERSION = 2
#: The version-1 table's name, and the table its public names are kept in by the upgrade.
V1_TABLE = "agents"
V1_NAMES = "v1_names"
_KEYS = """
CREATE TABLE IF NOT EXISTS keys (
    pubkey     TEXT PRIMARY KEY,
    owner      TEXT NOT NULL,
    auth_tag   TEXT,              -- NIP-OA tag as a JSON array of four strings, public
    mint_ref   TEXT UNIQUE,
    created_at INTEGER NOT NULL,
    updated_at INTEGER NOT NULL,
    deleted_at INTEGER,
    sealed     BLOB,
    CHECK (owner <> pubkey),
    CHECK ((deleted_at IS NULL) = (sealed IS NOT NULL))
) STRICT;
CREATE INDEX IF NOT EXISTS keys_by_owner ON keys (owner);
"""
_SCHEMA = _KEYS + """
-- Public facts about custody's keys: which token and KEK the blobs are sealed under, and
-- a rotation or migration in progress (custody/_rotation.py). Never a secret.
CREATE TABLE IF NOT EXISTS custody_meta (
    name  TEXT PRIMARY KEY,
    value TEXT NOT NULL
) STRICT;
-- Blobs resealed under a rotation's new KEK, waiting for the one swap transaction.
CREATE TABLE IF NOT EXISTS reseal (
    pubkey TEXT PRIMARY KEY REFERENCES keys (pubkey),
    sealed BLOB NOT NULL
) STRICT;
"""
#: Version 1 -> 2, run inside one transaction (see the module docstring).
_UPGRADE_FROM_1 = _KEYS + f"""
INSERT INTO keys (pubkey, owner, auth_tag, mint_ref, created_at, updated_at, deleted_at, sealed)
    SELECT pubkey, owner, auth_tag, mint_ref, created_at, updated_at, deleted_at, sealed
    FROM {V1_TABLE};
CREATE TABLE {V1_NAMES} (pubkey TEXT PRIMARY KEY, name TEXT NOT NULL, creator TEXT) STRICT;
INSERT INTO {V1_NAMES} (pubkey, name, creator) SELECT pubkey, name, creator FROM {V1_TABLE};
CREATE TABLE reseal_v2 (
    pubkey TEXT PRIMARY KEY REFERENCES keys (pubkey),
    sealed BLOB NOT NULL
) STRICT;
INSERT INTO reseal_v2 (pubkey, sealed) SELECT pubkey, sealed FROM reseal;
DROP TABLE reseal;
ALTER TABLE reseal_v2 RENAME TO reseal;
DROP TABLE {V1_TABLE};
"""
_PUBLIC_COLUMNS = "pubkey, owner, auth_tag, created_at, deleted_at, mint_ref"


def _record(row: Row) -> KeyRecord:
    pubkey, owner, auth_tag, created_at, deleted_at, mint_ref = row
    tag = tuple(json.loads(auth_tag)) if auth_tag is not None else None
    return KeyRecord(pubkey=pubkey, owner=owner, auth_tag=tag, created_at=created_at,
                     deleted_at=deleted_at, mint_ref=mint_ref)


def _readable_version(db: sqlite3.Connection, path: Path) -> int:
    """The file's schema version; CustodyError (`db` closed) if this build does not read it.
    Every opener asks here: a newer build's file would otherwise read as holding no keys."""
    version = int(db.execute("PRAGMA user_version").fetchone()[0])
    if version not in (0, 1, SCHEMA_VERSION):
        db.close()
        raise CustodyError(f"keystore {path} has schema version {version}; this build reads "
                           f"up to {SCHEMA_VERSION} (a newer build's keystore needs that build)")
    return version


def _upgrade_from_1(db: sqlite3.Connection) -> bool:
    """Version 1 -> 2 in one transaction (module docstring). False if another process
    upgraded it first (the table is gone once we hold the write lock)."""
    db.execute("BEGIN IMMEDIATE")
    try:
        present = db.execute("SELECT 1 FROM sqlite_schema WHERE type = 'table' AND name = ?",
                             (V1_TABLE,)).fetchone()
        if present:
            for statement in _UPGRADE_FROM_1.split(";"):
                if statement.strip():
                    db.execute(statement)
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")
    return bool(present)


def _prepare_dir(state_dir: Path) -> Path:
    try:
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if stat.S_IMODE(state_dir.stat().st_mode) & 0o077:
            os.chmod(state_dir, 0o700)
        path = state_dir / KEYSTORE_FILE
        # O_EXCL, never an open and close of an existing file: closing any descriptor of a
        # SQLite file drops this process's POSIX locks on it (daemon/state/_sqlite.py).
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
        except FileExistsError:
            if stat.S_IMODE(path.stat().st_mode) & 0o077:
                os.chmod(path, 0o600)
    except OSError as exc:
        raise CustodyError(f"cannot prepare keystore in {state_dir}: {exc.strerror}") from None
    return path


class _PublicReads:
    """The public lookups both readers offer, over their own `_rows` (one SELECT of
    `_PUBLIC_COLUMNS`, `where` being ours, never a caller's text)."""

    __slots__ = ()

    def _rows(self, where: str, args: tuple[object, ...] = ()) -> list[Row]:
        raise NotImplementedError

    def get(self, pubkey: str) -> KeyRecord | None:
        """The key's record, tombstones included; None if never held here."""
        rows = self._rows("WHERE pubkey = ?", (pubkey,))
        return _record(rows[0]) if rows else None

    def by_mint_ref(self, mint_ref: str) -> KeyRecord | None:
        rows = self._rows("WHERE mint_ref = ?", (mint_ref,))
        return _record(rows[0]) if rows else None

    def all(self, *, include_deleted: bool = False) -> list[KeyRecord]:
        where = "" if include_deleted else "WHERE deleted_at IS NULL"
        return [_record(row) for row in self._rows(f"{where} ORDER BY created_at, pubkey")]


class Keystore(_PublicReads):
    """Read-write keystore. Open with `Keystore.open(state_dir)`."""

    __slots__ = ("_db", "_lock", "path")

    def __init__(self, db: sqlite3.Connection, path: Path) -> None:
        self._db = db
        self._lock = threading.Lock()
        self.path = path

    @classmethod
    def open(cls, state_dir: Path) -> Self:
        path = _prepare_dir(state_dir)
        try:
            db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            # Zero deleted content in pages (a destroyed key's blob); see the module docstring.
            db.execute("PRAGMA secure_delete=ON")
            version = _readable_version(db, path)
            upgraded = version == 1 and _upgrade_from_1(db)
            db.executescript(_SCHEMA)
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except sqlite3.Error as exc:
            raise CustodyError(f"cannot open keystore {path}: {exc}") from None
        keystore = cls(db, path)
        if upgraded:
            log.info("keystore %s upgraded to schema version %d: names left custody",
                     path, SCHEMA_VERSION)
            # The dropped table's pages are zeroed; move them home and truncate the WAL.
            keystore._checkpoint_truncate()
        return keystore

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction under the writer's lock: committed whole, or rolled back."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _query(self, sql: str, args: tuple[object, ...] = ()) -> list[Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def _rows(self, where: str, args: tuple[object, ...] = ()) -> list[Row]:
        return self._query(f"SELECT {_PUBLIC_COLUMNS} FROM keys {where}", args)

    def sealed_blob(self, pubkey: str) -> bytes | None:
        """The sealed key of a live agent, else None."""
        rows = self._query("SELECT sealed FROM keys WHERE pubkey = ? AND deleted_at IS NULL", (pubkey,))
        return bytes(rows[0][0]) if rows else None

    def insert(self, record: KeyRecord, sealed: bytes, now: int) -> None:
        """Add a live agent, whole or not at all.

        Raises:
            CustodyError: the pubkey (live or tombstoned) or the mint_ref is already present.
        """
        tag = json.dumps(list(record.auth_tag)) if record.auth_tag is not None else None
        try:
            with self.transaction() as db:
                db.execute(
                    "INSERT INTO keys (pubkey, owner, auth_tag, mint_ref, created_at, updated_at,"
                    " deleted_at, sealed) VALUES (?, ?, ?, ?, ?, ?, NULL, ?)",
                    (record.pubkey, record.owner, tag, record.mint_ref, record.created_at,
                     now, sealed),
                )
        except sqlite3.IntegrityError:
            existing = self.get(record.pubkey)
            if existing is not None and existing.live:
                raise CustodyError(f"agent {record.pubkey} is already held") from None
            if existing is not None:
                raise CustodyError(
                    f"agent {record.pubkey} was removed; its tombstone is kept and it cannot return"
                ) from None
            raise CustodyError(f"mint_ref {record.mint_ref!r} is already used") from None
        except sqlite3.Error as exc:
            raise CustodyError(f"keystore write failed: {exc}") from None

    def _update_live(self, assignments: str, values: tuple[object, ...], pubkey: str) -> None:
        """One UPDATE of a live agent's row (`assignments` is ours, never an agent's text)."""
        try:
            with self.transaction() as db:
                db.execute(
                    f"UPDATE keys SET {assignments} WHERE pubkey = ? AND deleted_at IS NULL",
                    (*values, pubkey),
                )
        except sqlite3.Error as exc:
            raise CustodyError(f"keystore write failed: {exc}") from None

    def tombstone(self, pubkey: str, now: int) -> KeyRecord | None:
        """Destroy the sealed key, keep the record. None if the agent was never held."""
        self._update_live("sealed = NULL, deleted_at = ?, updated_at = ?", (now, now), pubkey)
        self._checkpoint_truncate()
        return self.get(pubkey)

    def _checkpoint_truncate(self) -> None:
        """Move the WAL into the database file and truncate it: the frames that held a
        destroyed blob go. Never fails the destroy that called it (already committed)."""
        try:
            with self._lock:
                # The checkpoint waits on readers through the busy handler; it runs in the
                # token worker, so wait briefly rather than the writers' full timeout.
                self._db.execute(f"PRAGMA busy_timeout={CHECKPOINT_BUSY_MS}")
                try:
                    busy, _, _ = self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
                finally:
                    self._db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        except sqlite3.Error as exc:
            log.warning("keystore WAL checkpoint failed (%s); a destroyed key's sealed blob "
                        "may remain in %s-wal until the next one", type(exc).__name__, self.path)
            return
        if busy:
            log.warning("keystore WAL checkpoint was blocked by a reader; a destroyed key's "
                        "sealed blob may remain in %s-wal until the next one", self.path)

    def set_auth_tag(self, pubkey: str, tag: tuple[str, str, str, str], now: int
                     ) -> KeyRecord | None:
        """Store a live agent's NIP-OA tag (public data). None if no live agent has that key."""
        self._update_live("auth_tag = ?, updated_at = ?", (json.dumps(list(tag)), now), pubkey)
        record = self.get(pubkey)
        return record if record is not None and record.live else None

    # --- custody's own facts (the rotation's writes are `_rotation.Staging`'s) ----------

    def meta(self) -> dict[str, str]:
        return dict(self._query("SELECT name, value FROM custody_meta"))

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __repr__(self) -> str:
        return f"Keystore({str(self.path)!r})"


class ReadIndex(_PublicReads):
    """Custody's public facts about every key, read-only: no token, no secret column, and
    nothing created (a missing keystore reads as empty). Thread-safe. `Custody`'s public
    reads, after its writer opened (and so upgraded) the file; `custody.KeyIndex` adds what
    a reader without custody open needs.

    Raises `CustodyError` (naming the file, never a row) when the file cannot be read.
    """

    __slots__ = ("path", "_db", "_lock")

    def __init__(self, path: Path) -> None:
        self.path = path
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()

    def _first(self, queries: tuple[str, ...], args: tuple[object, ...] = ()
               ) -> list[Row]:
        """The rows of the first query whose table exists (the current table before the
        version-1 one); none if no table does, or no keystore exists yet."""
        with self._lock:
            if self._db is None:
                if not self.path.exists():
                    return []
                try:
                    db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True,
                                         check_same_thread=False)
                    _readable_version(db, self.path)
                    self._db = db
                except sqlite3.Error as exc:
                    raise CustodyError(f"cannot open keystore {self.path}: {exc}") from None
            for sql in queries:
                try:
                    return self._db.execute(sql, args).fetchall()
                except sqlite3.OperationalError as exc:
                    if "no such table" not in str(exc):
                        raise CustodyError(f"cannot read keystore {self.path}: {exc}") from None
                except sqlite3.Error as exc:
                    raise CustodyError(f"cannot read keystore {self.path}: {exc}") from None
            return []

    def _rows(self, where: str, args: tuple[object, ...] = ()) -> list[Row]:
        return self._first((f"SELECT {_PUBLIC_COLUMNS} FROM keys {where}",), args)

    def count(self) -> int:
        """Records held, destroyed ones included (0 while no keystore exists)."""
        rows = self._first(("SELECT count(*) FROM keys",))
        return int(rows[0][0]) if rows else 0

    def version(self) -> int:
        """Changes whenever a key record may have changed: a commit by any other connection,
        custody's own writer and other processes included (SQLite's data_version, read
        from shared memory: no disk read). 0 while no keystore exists."""
        rows = self._first(("PRAGMA data_version",))
        return int(rows[0][0]) if rows else 0

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r})"


def read_meta(state_dir: Path) -> dict[str, str]:
    """Custody's public facts (active token and KEK) read-only, creating nothing: empty
    before any rotation or when no keystore exists yet."""
    path = Path(state_dir) / KEYSTORE_FILE
    if not path.exists():
        return {}
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            _readable_version(db, path)
            return dict(db.execute("SELECT name, value FROM custody_meta").fetchall())
        finally:
            db.close()
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):
            return {}
        raise CustodyError(f"cannot read keystore {path}: {exc}") from None
    except sqlite3.Error as exc:
        raise CustodyError(f"cannot read keystore {path}: {exc}") from None
