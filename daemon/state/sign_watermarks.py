"""The last version of each replaceable event this host published: a double-sign guard.

Why: `agents.update` and `profile.set` merge into the version the relay calls newest and
re-sign the result with a later created_at. A relay that withholds the latest version
could have an older one (an old `system_prompt`, `lud16`, `nip05`) re-signed as new
(issue 22 L4). Like a validator's signer, which refuses to sign below the height it last
signed, the host remembers per (author, kind, `d`) the created_at and id of the last
version it published, and the operations refuse to build on anything older.

"Published" and not "signed": daemon/relay/pool.py records an event the relay accepted
or may have taken (no answer; the ledger retries those bytes). A version signed and then
lost to a fault before sending, or refused by the relay, cannot be the relay's newest;
recording it would refuse every later merge of that event for good.

Rules:
- One row per (agent, kind, d); `d` is "" for a plain replaceable kind (kind 0).
- `record` only moves forward: a version older than the one kept (an out-of-order
  write, a retry) does not lower the watermark.
- Only the kinds an operation checks are kept (`GUARDED_KINDS`: profile.set's and
  agents.update's kind 0, agents.update's 30177); `record` of any other kind writes
  nothing. A watermark nothing reads guards nothing, and storage.put's kind 30174, whose
  `d` the client picks (the slug), would otherwise add a row per slug for good. Rows left
  by older versions of other kinds are deleted when the store opens.
- Bounded by what the host holds, not by what a client sends: a kind 0 row per agent
  (d ""), a 30177 row per managed agent (d = its pubkey, under its owner), so at most
  two rows per key that can still sign here. A key's rows go once it cannot (`prune`,
  run when the daemon starts and after each destroy: agents.delete, a failed
  agents.create's key, `agent remove`), and a watermark guards nothing for a key that
  never signs again: with custody in the daemon that is when the key is destroyed (its
  tombstone refuses it back, an import or a restore alike); a custodian's `--recover`
  brings a destroyed key back within its grace period, which the daemon is not told, so
  there its rows stay while the custodian keeps its record, and go once that is forgotten
  (`--forget-destroyed`): bounded by `[custodian] max_records` as the records are
  (tests/adversarial/test_churn_residue.py::
  test_a_deleted_agents_watermarks_and_runtime_go_once_the_custodian_forgets_its_record). A
  30177 row goes with the managed agent it describes (its `d`) as well as with its author.
  Beyond that, `MAX_ROWS_PER_AGENT` caps one author's rows: past it, the author's rows
  with the oldest created_at are evicted. An evicted row costs what a lost write costs
  (below), for the record published longest ago.
- `record` and `prune` block for a commit's fsync (synchronous=FULL) and up to the busy timeout
  behind another writer (an operator's sqlite3, a backup), so the daemon runs it in a
  worker thread, never on the event loop; it writes on a connection of its own opened in
  that thread (as `daemon.state.runtimes.RuntimeStore.set`). The store's own connection
  stays the loop's, for `get`, and a reader there never waits on a writer (WAL).
- A lost write (a locked or full disk; the pool logs it and keeps the relay's verdict)
  leaves the watermark at the version before: it never moves backwards, so no later
  event goes backwards either (created_at comes from the relay's newest version,
  `next_created_at`, not from here). What it costs: until the next version of that
  (author, kind, d) is recorded, the guard holds the floor one version low, so a relay
  that withholds exactly the version whose write was lost could have the one before it
  merged and re-signed, as before the guard existed, for that one version.
- Public data only (pubkeys, kinds, ids). Faults are `sqlite3.Error` (or `OSError`
  opening the writer's connection), handled like every other store fault.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from buzzwire import kinds
from daemon.state._sqlite import open_private_db, transaction

__all__ = ["SignWatermarks", "Watermark", "WATERMARKS_DB", "GUARDED_KINDS",
           "MAX_ROWS_PER_AGENT", "signers"]

#: File name inside the state directory.
WATERMARKS_DB = "watermarks.db"

#: The kinds whose watermark an operation reads (`check_builds_on_latest`): the only
#: ones kept (tests/test_sign_watermarks.py holds the operations to this set).
GUARDED_KINDS: frozenset[int] = frozenset({kinds.METADATA, kinds.MANAGED_AGENT})

#: One author's rows at most (about 400 bytes each on disk): a kind 0 and a 30177 per
#: managed agent it ever owned. Past it the oldest-published are evicted (module docstring).
MAX_ROWS_PER_AGENT = 4096

_SCHEMA = """
CREATE TABLE IF NOT EXISTS watermarks (
    agent      TEXT NOT NULL,
    kind       INTEGER NOT NULL,
    d          TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    event_id   TEXT NOT NULL,
    PRIMARY KEY (agent, kind, d)
) STRICT;
"""


class _Held(Protocol):
    """A key record as custody or the directory gives it (`KeyRecord`, `AgentRecord`)."""

    @property
    def pubkey(self) -> str: ...
    @property
    def live(self) -> bool: ...


def signers(records: Iterable[_Held], *, custodian: bool) -> set[str]:
    """The keys whose rows are kept (module docstring): the live ones; with a custodian,
    every one it has a record of, since its `--recover` may bring a destroyed one back."""
    return {r.pubkey for r in records if custodian or r.live}


@dataclass(frozen=True, slots=True)
class Watermark:
    """The last version signed here of one replaceable event."""

    created_at: int
    event_id: str


class SignWatermarks:
    """(agent, kind, d) -> the `Watermark` of the last version this host published."""

    def __init__(self, db: sqlite3.Connection, path: Path | None = None,
                 max_rows_per_agent: int = MAX_ROWS_PER_AGENT) -> None:
        if max_rows_per_agent < 1:
            raise ValueError("max_rows_per_agent must be >= 1")
        self._db = db
        self._path = path
        self._max_rows = max_rows_per_agent

    @classmethod
    def open(cls, state_dir: Path, max_rows_per_agent: int = MAX_ROWS_PER_AGENT
             ) -> SignWatermarks:
        path = state_dir / WATERMARKS_DB
        db = open_private_db(path, _SCHEMA)
        try:
            # Rows an older version kept for kinds nothing reads (storage.put's slugs).
            db.execute("DELETE FROM watermarks WHERE kind NOT IN (%s)"
                       % ", ".join(str(k) for k in sorted(GUARDED_KINDS)))
        except BaseException:
            db.close()
            raise
        return cls(db, path, max_rows_per_agent)

    def get(self, agent: str, kind: int, d: str) -> Watermark | None:
        row = self._db.execute(
            "SELECT created_at, event_id FROM watermarks WHERE agent = ? AND kind = ? AND d = ?",
            (agent, kind, d),
        ).fetchone()
        return None if row is None else Watermark(int(row[0]), str(row[1]))

    def record(self, agent: str, kind: int, d: str, created_at: int, event_id: str) -> None:
        """Raise the watermark of (agent, kind, d) to this version, durably; evict past the cap.

        Blocking (an fsync, and the busy timeout behind another writer): call it from a
        worker thread. A connection per call, opened here: writes are rare (profile.set,
        agents.*), and a connection one thread uses needs no lock. A kind not in
        `GUARDED_KINDS` writes nothing and opens nothing.

        Raises:
            sqlite3.Error / OSError: the write failed; the watermark is as it was.
        """
        if kind not in GUARDED_KINDS:
            return
        with self._writing() as writer:
            writer.execute(
                "INSERT INTO watermarks (agent, kind, d, created_at, event_id) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT (agent, kind, d) DO UPDATE SET "
                "created_at = excluded.created_at, event_id = excluded.event_id "
                "WHERE excluded.created_at > watermarks.created_at",
                (agent, kind, d, created_at, event_id),
            )
            # The author's oldest-published rows past the cap (ties: the lower rowid,
            # the earlier row written, goes first).
            writer.execute(
                "DELETE FROM watermarks WHERE rowid IN (SELECT rowid FROM watermarks "
                "WHERE agent = ? ORDER BY created_at DESC, rowid DESC LIMIT -1 OFFSET ?)",
                (agent, self._max_rows),
            )

    def agents(self) -> set[str]:
        """The keys rows are kept for: their authors, and the managed agents 30177 rows
        describe. Blocking (a connection of its own, as `prune`)."""
        reader = self._db if self._path is None else open_private_db(self._path, "")
        try:
            return {key for (key,) in reader.execute(
                "SELECT agent FROM watermarks UNION SELECT d FROM watermarks WHERE kind = ?",
                (kinds.MANAGED_AGENT,))}
        finally:
            if reader is not self._db:
                reader.close()

    def prune(self, kept: Callable[[], Collection[str]]) -> int:
        """Delete the rows of keys not in `kept()` (`signers`): a row whose author is not,
        or a 30177 row whose `d`, the managed agent it describes, is not; how many went.

        `kept` is read inside the write transaction: a key's rows are recorded only once
        the daemon holds the key (it published for it), so a row written before the
        transaction began is of a key `kept()`, read after, knows. Blocking, as `record`.

        Raises:
            sqlite3.Error / OSError: the write failed; the rows are as they were.
        """
        with self._writing() as writer:
            keys = json.dumps(sorted(kept()))
            return writer.execute(
                "DELETE FROM watermarks WHERE agent NOT IN (SELECT value FROM json_each(?))"
                " OR (kind = ? AND d NOT IN (SELECT value FROM json_each(?)))",
                (keys, kinds.MANAGED_AGENT, keys)).rowcount

    def forget(self, pubkeys: Collection[str]) -> int:
        """Delete the rows by `pubkeys` or about them (a 30177 whose `d` is one): keys whose
        records were forgotten; how many went. Blocking, as `record`."""
        with self._writing() as writer:
            keys = json.dumps(sorted(pubkeys))
            return writer.execute(
                "DELETE FROM watermarks WHERE agent IN (SELECT value FROM json_each(?))"
                " OR (kind = ? AND d IN (SELECT value FROM json_each(?)))",
                (keys, kinds.MANAGED_AGENT, keys)).rowcount

    @contextmanager
    def _writing(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, on a connection of its own opened in the calling thread
        (a connection one thread uses needs no lock); rolled back if the block raises."""
        writer = self._db if self._path is None else open_private_db(self._path, "")
        try:
            with transaction(writer):
                yield writer
        finally:
            if writer is not self._db:
                writer.close()

    def close(self) -> None:
        self._db.close()
