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
- Public data only (pubkeys, kinds, ids). Faults are `sqlite3.Error`, handled like every
  other store fault.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path

from daemon.state._sqlite import open_private_db

__all__ = ["SignWatermarks", "Watermark", "WATERMARKS_DB"]

#: File name inside the state directory.
WATERMARKS_DB = "watermarks.db"

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


@dataclass(frozen=True, slots=True)
class Watermark:
    """The last version signed here of one replaceable event."""

    created_at: int
    event_id: str


class SignWatermarks:
    """(agent, kind, d) -> the `Watermark` of the last version this host signed."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    @classmethod
    def open(cls, state_dir: Path) -> SignWatermarks:
        return cls(open_private_db(state_dir / WATERMARKS_DB, _SCHEMA))

    def get(self, agent: str, kind: int, d: str) -> Watermark | None:
        row = self._db.execute(
            "SELECT created_at, event_id FROM watermarks WHERE agent = ? AND kind = ? AND d = ?",
            (agent, kind, d),
        ).fetchone()
        return None if row is None else Watermark(int(row[0]), str(row[1]))

    def record(self, agent: str, kind: int, d: str, created_at: int, event_id: str) -> None:
        self._db.execute(
            "INSERT INTO watermarks (agent, kind, d, created_at, event_id) VALUES (?, ?, ?, ?, ?) "
            "ON CONFLICT (agent, kind, d) DO UPDATE SET created_at = excluded.created_at, "
            "event_id = excluded.event_id WHERE excluded.created_at > watermarks.created_at",
            (agent, kind, d, created_at, event_id),
        )

    def close(self) -> None:
        self._db.close()
