"""The public agent directory: names, depth, renames, tombstones, mint references, listing.

No secret is here. Custody keeps the secrets (each agent's sealed key, its owner and its
NIP-OA tag) and the calls that need one; everything else about an agent is read, and its
name is changed, through this module, without custody and without the token: policy
(requester, target by name, depth), agents.update's rename, the minted-key lookup of a
failed agents.create, the daemon's startup listing, `agent list`, `status` and
`credential issue`.

Where the rows live, and why there: in the `agents` table of custody's keystore.db, the
same rows the key is sealed in. A key and its public record are written in ONE transaction
when custody mints, imports or restores (a crash leaves neither or both, never a name
without a key), and destroyed as ONE tombstone; a second file would need a two-file commit
that SQLite does not give. So custody writes a row whole, and this module reads only the
public columns of it (never `sealed`) and writes only `name` (and `updated_at`). State
directories from before this module need no migration: the table is the same.

Rules:
- The depth rule is stated here once (`child_depth`): an agent whose owner is not held
  here (a person) is at depth 1; an agent owned by a live agent held here sits one level
  below it. Policy's limit, agents.create and `agent create`/`agent import` all use it.
- Reads go through one read-only connection; a keystore that does not exist yet reads as
  empty and is not created. A rename opens its own short read-write connection (WAL: it
  never blocks custody's readers, and custody's records_version sees the commit as
  another connection's, so the broker's liveness cache stays right) with secure_delete on,
  as custody's own is: the rewritten row sits in a page beside sealed blobs.
- Faults are `DirectoryError`, whose message names the file and never a row's content.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from custody import AgentRecord
from buzzwire.nostr import is_hex64

__all__ = ["AgentDirectory", "DirectoryError", "HUMAN_OWNED_DEPTH", "child_depth", "KEYSTORE_FILE"]

#: The file custody keeps its keystore in (custody's own name for it; the table is shared).
KEYSTORE_FILE = "keystore.db"
#: An agent whose owner is not held on this host (a human) is at depth 1.
HUMAN_OWNED_DEPTH = 1
#: How long a rename waits for custody's write (a mint in progress) before it fails.
BUSY_TIMEOUT_MS = 5000
_COLUMNS = "pubkey, owner, name, auth_tag, creator, depth, created_at, deleted_at, mint_ref"


class _Placed(Protocol):
    """What the depth rule reads of an owner's record (AgentRecord, policy's AgentView)."""

    @property
    def depth(self) -> int: ...
    @property
    def deleted_at(self) -> int | None: ...


class DirectoryError(Exception):
    """The directory could not be read or written; the message names the file."""


def child_depth(owner: _Placed | None) -> int:
    """The depth of an agent owned by `owner` (None: not held here, or removed)."""
    if owner is None or owner.deleted_at is not None:
        return HUMAN_OWNED_DEPTH
    return owner.depth + 1


def _record(row: tuple[Any, ...]) -> AgentRecord:
    pubkey, owner, name, auth_tag, creator, depth, created_at, deleted_at, mint_ref = row
    tag = tuple(json.loads(auth_tag)) if auth_tag is not None else None
    return AgentRecord(pubkey=pubkey, owner=owner, name=name, auth_tag=tag, creator=creator,
                       depth=depth, created_at=created_at, deleted_at=deleted_at,
                       mint_ref=mint_ref)


class AgentDirectory:
    """Every agent's public record. `AgentDirectory.open(state_dir)`; thread-safe."""

    __slots__ = ("_path", "_db", "_lock")

    def __init__(self, path: Path) -> None:
        self._path = path
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()

    @classmethod
    def open(cls, state_dir: Path | str) -> AgentDirectory:
        return cls(Path(state_dir) / KEYSTORE_FILE)

    def _rows(self, sql: str, args: tuple[object, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            if self._db is None:
                if not self._path.exists():
                    return []
                try:
                    self._db = sqlite3.connect(
                        f"file:{self._path}?mode=ro", uri=True, check_same_thread=False
                    )
                except sqlite3.Error as exc:
                    raise DirectoryError(f"cannot open keystore {self._path}: {exc}") from None
            try:
                return self._db.execute(sql, args).fetchall()
            except sqlite3.OperationalError as exc:
                if "no such table" in str(exc):
                    return []
                raise DirectoryError(f"cannot read keystore {self._path}: {exc}") from None

    def get(self, pubkey: str) -> AgentRecord | None:
        """The record, tombstones included; None if never held (or not a pubkey)."""
        if not is_hex64(pubkey):
            return None
        rows = self._rows(f"SELECT {_COLUMNS} FROM agents WHERE pubkey = ?", (pubkey,))
        return _record(rows[0]) if rows else None

    def agent(self, pubkey: str) -> AgentRecord | None:
        """The live agent's record; None if unknown or removed."""
        record = self.get(pubkey)
        return record if record is not None and record.live else None

    def by_mint_ref(self, mint_ref: str) -> AgentRecord | None:
        rows = self._rows(f"SELECT {_COLUMNS} FROM agents WHERE mint_ref = ?", (mint_ref,))
        return _record(rows[0]) if rows else None

    def agents(self, *, include_deleted: bool = False) -> list[AgentRecord]:
        where = "" if include_deleted else "WHERE deleted_at IS NULL"
        rows = self._rows(f"SELECT {_COLUMNS} FROM agents {where} ORDER BY created_at, pubkey")
        return [_record(row) for row in rows]

    def rename(self, pubkey: str, name: str, now: int | None = None) -> AgentRecord | None:
        """Set a live agent's public name. None if no live agent has that key.

        Raises:
            ValueError: an empty name or a malformed pubkey.
            DirectoryError: the keystore could not be written.
        """
        if not is_hex64(pubkey):
            raise ValueError("agent must be 64 lowercase hex characters")
        if not isinstance(name, str) or not name:
            raise ValueError("name must be a non-empty str")
        if not self._path.exists():
            return None
        stamp = int(time.time()) if now is None else now
        try:
            db = sqlite3.connect(self._path, isolation_level=None)
            try:
                db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
                db.execute("PRAGMA secure_delete=ON")
                db.execute("UPDATE agents SET name = ?, updated_at = ?"
                           " WHERE pubkey = ? AND deleted_at IS NULL", (name, stamp, pubkey))
            finally:
                db.close()
        except sqlite3.Error as exc:
            raise DirectoryError(f"cannot write keystore {self._path}: {exc}") from None
        return self.agent(pubkey)

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
