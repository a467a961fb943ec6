"""The runtime each managed agent resolved to: the host's own record, never the relay's.

Buzz's kind registry says the kind 30177 record is a world-readable allowlist projection
that never carries runtime fields (shared/spec/wire-schema.md), so the runtime an
`agents.create` / `agents.update` named lives here, beside the state the host keeps.

Rules:
- One row per agent (`pubkey`, `runtime`); writing is idempotent (the pipeline's
  housekeeping may run twice after a crash), so `set` is an upsert. A row goes with its
  key, as its relay watermarks do (`prune`, daemon/state/leftovers.py): kept while the key
  can sign here (agents.update reads it), so bounded by `max_records`.
- Public data only: a runtime name, never a key or credential.
- Faults are `sqlite3.Error`; the pipeline turns them into `internal` verdicts or
  housekeeping log lines like every other store fault.
- `set` blocks for a commit's fsync (synchronous=FULL), so the daemon runs it in a worker
  thread (`trio.to_thread.run_sync`), never on the event loop (issue 22, L6). It writes on
  a connection of its own, opened in that thread: the store's own connection stays the
  loop's, for `get`, and a reader there never waits on the writer's fsync (WAL).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Collection
from pathlib import Path

from daemon.state._sqlite import open_private_db, transaction

__all__ = ["RuntimeStore", "RUNTIMES_DB"]

#: File name inside the state directory.
RUNTIMES_DB = "runtimes.db"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runtimes (
    pubkey     TEXT PRIMARY KEY,
    runtime    TEXT NOT NULL,
    updated_at INTEGER NOT NULL
) STRICT;
"""


class RuntimeStore:
    """agent pubkey -> the runtime the host resolved for it."""

    def __init__(self, db: sqlite3.Connection, path: Path) -> None:
        self._db = db
        self._path = path

    @classmethod
    def open(cls, state_dir: Path) -> RuntimeStore:
        path = state_dir / RUNTIMES_DB
        return cls(open_private_db(path, _SCHEMA), path)

    def get(self, pubkey: str) -> str | None:
        row = self._db.execute("SELECT runtime FROM runtimes WHERE pubkey = ?", (pubkey,)).fetchone()
        return None if row is None else str(row[0])

    def set(self, pubkey: str, runtime: str, now: int) -> None:
        """Upsert the agent's runtime, durably. Blocking: call it from a worker thread.

        A connection per call: writes are rare (agents.create / update), and a connection
        used by one thread only needs no lock.
        """
        writer = open_private_db(self._path, "")
        try:
            writer.execute(
                "INSERT INTO runtimes (pubkey, runtime, updated_at) VALUES (?, ?, ?) "
                "ON CONFLICT (pubkey) DO UPDATE SET runtime = excluded.runtime, "
                "updated_at = excluded.updated_at",
                (pubkey, runtime, now),
            )
        finally:
            writer.close()

    def agents(self) -> frozenset[str]:
        """The pubkeys that have a row. Blocking (a connection of its own, as `prune`)."""
        reader = open_private_db(self._path, "")
        try:
            return frozenset(p for (p,) in reader.execute("SELECT pubkey FROM runtimes"))
        finally:
            reader.close()

    def prune(self, kept: Callable[[], Collection[str]]) -> int:
        """Delete the rows of agents not in `kept()`, read inside the write transaction (a
        row is written only for a key the daemon holds); how many went. Blocking."""
        writer = open_private_db(self._path, "")
        try:
            with transaction(writer):
                gone = writer.execute(
                    "DELETE FROM runtimes WHERE pubkey NOT IN (SELECT value FROM json_each(?))",
                    (json.dumps(sorted(kept())),)).rowcount
        finally:
            writer.close()
        return gone

    def forget(self, pubkeys: Collection[str]) -> int:
        """Delete the rows of `pubkeys` (keys whose records were forgotten); how many
        went. Blocking."""
        writer = open_private_db(self._path, "")
        try:
            return writer.execute(
                "DELETE FROM runtimes WHERE pubkey IN (SELECT value FROM json_each(?))",
                (json.dumps(sorted(pubkeys)),)).rowcount
        finally:
            writer.close()

    def close(self) -> None:
        self._db.close()
