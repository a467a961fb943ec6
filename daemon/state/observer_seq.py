"""NIP-AO `seq` numbers: monotonic per agent, across requests and restarts.

Rules (NIP-AO "Decrypted Payload": `seq` is monotonically increasing, for drop detection):
- `take(agent, n)` hands out `n` consecutive numbers, each greater than every number this
  state directory ever handed out for `agent`, in this process or an earlier one.
- Durable by reservation, not by number: the store commits a *ceiling* per agent (one
  fsync, SQLite synchronous=FULL) before handing out any number below it, reserving
  `BLOCK` numbers at a time. A restart starts at the stored ceiling, so numbers reserved
  but never used before a crash are skipped: a gap, never a repeat. A gap is what NIP-AO's
  drop detection should see anyway: frames queued at a crash are lost.
- Numbers of frames the queue did not admit (their share filled during the request, or
  too big for NIP-44) are not reused either: the owner sees the gap where frames were
  dropped. A request that finds its share already full takes no numbers at all
  (observer_emit's shortcut): frames dropped so leave no gap, and the owner learns of
  them only as the agent does, from `accepted`
  (tests/e2e/test_observer.py::test_a_full_share_costs_custody_and_the_seq_store_nothing).
- One writer: the daemon (its run lock). The commit runs in a worker thread under a trio
  lock, so the event loop never waits on the fsync and two requests never race a ceiling.

Public data only (counters keyed by agent pubkey).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Final

import trio

from daemon.state._sqlite import open_private_db

__all__ = ["ObserverSeq", "OBSERVER_SEQ_DB", "BLOCK"]

#: File name inside the state directory.
OBSERVER_SEQ_DB: Final = "observer_seq.db"
#: Numbers reserved per commit: one fsync per 4,096 frames of one agent at most, and a
#: restart skips fewer than that many numbers.
BLOCK: Final = 4096

_SCHEMA = """
CREATE TABLE IF NOT EXISTS observer_seq (
    agent   TEXT PRIMARY KEY,
    ceiling INTEGER NOT NULL
) STRICT;
"""


class ObserverSeq:
    """agent pubkey -> the next `seq` (module docstring)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db
        #: agent -> (next number to hand out, committed ceiling: next < ceiling holds)
        self._next: dict[str, tuple[int, int]] = {}
        self._lock = trio.Lock()

    @classmethod
    def open(cls, state_dir: Path) -> ObserverSeq:
        """Open (creating) `<state>/observer_seq.db`.

        Raises:
            OSError, sqlite3.Error: the file cannot be created or opened.
        """
        return cls(open_private_db(state_dir / OBSERVER_SEQ_DB, _SCHEMA))

    async def take(self, agent: str, n: int) -> range:
        """`n` fresh consecutive numbers for `agent`, committed before they are handed out.

        Raises:
            ValueError: n < 1 (our bug).
            sqlite3.Error: the ceiling could not be committed (nothing is handed out).
        """
        if n < 1:
            raise ValueError("take at least one number")
        async with self._lock:
            known = self._next.get(agent)
            start, ceiling = known if known is not None else await trio.to_thread.run_sync(
                self._stored, agent)
            end = start + n
            if end > ceiling:
                ceiling = end + BLOCK
                await trio.to_thread.run_sync(self._commit, agent, ceiling)
            self._next[agent] = (end, ceiling)
            return range(start, end)

    def _stored(self, agent: str) -> tuple[int, int]:
        # First use in this process: start at the ceiling an earlier process committed
        # (numbers below it may have been handed out), or at 1 for a new agent.
        row = self._db.execute("SELECT ceiling FROM observer_seq WHERE agent = ?",
                               (agent,)).fetchone()
        start = 1 if row is None else int(row[0])
        return start, start

    def _commit(self, agent: str, ceiling: int) -> None:
        self._db.execute(
            "INSERT INTO observer_seq (agent, ceiling) VALUES (?, ?) "
            "ON CONFLICT (agent) DO UPDATE SET ceiling = excluded.ceiling", (agent, ceiling))

    def close(self) -> None:
        self._db.close()
