"""Durable idempotency: (principal, requestId) -> digest, state, pending work, verdict.

Theory of operation (design.md "Idempotency: the ledger"; spec I3):

- The key is `LedgerKey(principal, request_id)`. The principal is whatever string the
  pipeline authenticated (the agent pubkey is the recommended one: a credential rotated
  between two attempts must not turn a retry into a new operation). Two principals using
  the same requestId are two independent records, always.
- The value is the sha256 `digest` of the received body bytes, a `state`, an optional
  `pending` blob (the signed event(s) an operation will publish, opaque to the ledger)
  and the encoded `response` bytes (opaque too; the caller marks replays).
- `begin(key, digest)` decides, in this order:
    1. the same key is in flight in this process with another digest -> `Conflict()` at once;
    2. the same key and digest is in flight -> wait for its owner, then look again
       (a final verdict the owner just recorded is handed over without touching SQLite);
    3. no record -> `Fresh(ticket)`; a record with another digest -> `Conflict()` (the
       record is untouched); a final record -> `Replay(response)`; a pending or
       indeterminate record that holds pending work -> `Resume(ticket, pending)`; an
       indeterminate record without pending work (nothing was ever sent) -> `Fresh(ticket)`.
  Whoever receives a ticket owns the key in this process until `finish()` or `release()`.
- `record_pending` commits before it returns (synchronous=FULL) — the caller must not let
  anything reach the relay before it returns. The pending blob is write-once: a retry
  re-sends exactly those events, never re-signed ones.
- `finish(final=True)` records a final verdict (succeeded or failed; the ledger does not
  read the verdict bytes, so both are the one state FINAL). `finish(final=False)` records
  an indeterminate verdict and keeps the pending blob: indeterminate is never final, the
  next identical retry gets `Resume`.
- States move only through `advance(state, event)`, one lookup in `TRANSITIONS`; a missing
  pair is our bug (AssertionError naming state and event).

I/O: SQLite in WAL mode. Writes go through one dedicated connection, used only from trio
worker threads under this ledger's own CapacityLimiter(1). Group commit (the engine is
daemon/_group_commit.py, shared with the audit log): every write is queued as an
operation; the first task to find no flush running becomes the flusher and runs
everything queued in one transaction (one fsync) per thread hop, repeating until the
queue is empty. Under load, many concurrent requests share one fsync and one ~150 µs
thread hop; a lone request pays one of each. The flush runs shielded from cancellation:
other tasks' durability depends on it, and it is bounded by the batch.

`begin`'s lookup is the one read on the hot path, and it runs on the event-loop thread
on a second, read-only connection: a primary-key SELECT costs ~10 µs, a thread hop ~150.
That is safe because (a) in WAL mode a reader never waits for the writer (it reads the
last committed snapshot), (b) the key is claimed in the in-flight map before the SELECT,
and every write for a key is made by its in-process owner and committed before the owner
lets go — so the snapshot the SELECT sees already holds everything an owner wrote, and
(c) the SELECT is synchronous, so no other task runs between the claim and the answer.
Its busy timeout is short (`READ_BUSY_TIMEOUT_MS`): a WAL reader is only ever kept waiting
while SQLite rebuilds its shared index, and the event loop must not stall for long.

Retention: `sweep(now)` deletes final records older than `retention_seconds` and
pending/indeterminate ones older than `STALE_FACTOR` x retention (a retry that late gets
a fresh execution; the database must stay bounded). Keys in flight are never swept.

WARNING: one process owns a ledger file. The in-flight map is per process; a second daemon
on the same file would not see the first one's owners. Keep `TRANSITIONS`, the `State`
values stored in SQLite, and `_SCHEMA` in sync.
"""

from __future__ import annotations

import enum
import sqlite3
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeAlias

import trio

from daemon._group_commit import Failed, GroupCommit
from daemon._sqlite import open_private_db

__all__ = [
    "LedgerKey",
    "Ledger",
    "Ticket",
    "Fresh",
    "Resume",
    "Replay",
    "Conflict",
    "Begin",
    "State",
    "LedgerEvent",
    "TRANSITIONS",
    "advance",
    "DIGEST_BYTES",
    "STALE_FACTOR",
    "LEDGER_FILENAME",
    "READ_BUSY_TIMEOUT_MS",
]

#: The file name under the state directory (design.md: `<state>/ledger.db`).
LEDGER_FILENAME: Final = "ledger.db"

#: sha256 of the received body bytes (spec I3).
DIGEST_BYTES: Final = 32

#: Pending and indeterminate records are kept this many retention periods before a sweep
#: may drop them: they are the only memory of events that may be on the relay, so they
#: outlive final verdicts; but the database must stay bounded, so not forever.
STALE_FACTOR: Final = 2

#: How long `begin`'s read on the event-loop thread may wait for SQLite's shared index
#: (module docstring); beyond that the read fails like any database fault.
READ_BUSY_TIMEOUT_MS: Final = 100


class State(enum.Enum):
    """Where one (principal, requestId) record stands. Values are what SQLite stores."""

    #: No record yet: the owner holds a Fresh ticket and nothing is durable.
    NEW = "new"
    #: The signed work is durable; it may or may not have reached the relay.
    PENDING = "pending"
    #: A verdict was reached that promises nothing (outcome_unknown / internal mid-way).
    #: Never final: the next identical retry reconciles.
    INDETERMINATE = "indeterminate"
    #: succeeded or failed: replayed verbatim from now on.
    FINAL = "final"


class LedgerEvent(enum.Enum):
    """What an owner reports about its execution."""

    RECORD_PENDING = "record_pending"
    FINISH_FINAL = "finish_final"
    FINISH_INDETERMINATE = "finish_indeterminate"


#: (state, event) -> next state. A pair that is absent is a programming error in the
#: pipeline (e.g. recording a verdict over a final one, or replacing pending work).
TRANSITIONS: Final[Mapping[tuple[State, LedgerEvent], State]] = {
    # A fresh request either plans side effects (pending first) or ends at once
    # (a read, a refusal, a fault before dispatch).
    (State.NEW, LedgerEvent.RECORD_PENDING): State.PENDING,
    (State.NEW, LedgerEvent.FINISH_FINAL): State.FINAL,
    (State.NEW, LedgerEvent.FINISH_INDETERMINATE): State.INDETERMINATE,
    # The relay answered (or did not): the verdict settles the pending work.
    (State.PENDING, LedgerEvent.FINISH_FINAL): State.FINAL,
    (State.PENDING, LedgerEvent.FINISH_INDETERMINATE): State.INDETERMINATE,
    # A retry of an indeterminate record. RECORD_PENDING is legal only when the earlier
    # attempt never recorded pending work (the ledger refuses to replace a blob).
    (State.INDETERMINATE, LedgerEvent.RECORD_PENDING): State.PENDING,
    (State.INDETERMINATE, LedgerEvent.FINISH_FINAL): State.FINAL,
    (State.INDETERMINATE, LedgerEvent.FINISH_INDETERMINATE): State.INDETERMINATE,
}


def advance(state: State, event: LedgerEvent) -> State:
    """The one state-machine step. Raises AssertionError (our bug) on a forbidden pair."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise AssertionError(f"ledger: {event.name} is not allowed in state {state.name}") from None


@dataclass(frozen=True, slots=True)
class LedgerKey:
    """The idempotency key: the authenticated principal and the caller's requestId."""

    principal: str
    request_id: str

    def __post_init__(self) -> None:
        if not isinstance(self.principal, str) or not self.principal:
            raise ValueError("LedgerKey.principal must be a non-empty str")
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError("LedgerKey.request_id must be a non-empty str")


@dataclass(frozen=True, slots=True, eq=False)
class Ticket:
    """Ownership of one key in this process, from begin() until finish()/release().

    Compared by identity: a copied or stale ticket is not the owner.
    """

    key: LedgerKey
    digest: bytes


@dataclass(frozen=True, slots=True)
class Fresh:
    """Run the request: nothing durable exists for it (or nothing was ever sent)."""

    ticket: Ticket


@dataclass(frozen=True, slots=True)
class Resume:
    """Finish the request by re-sending exactly `pending`; never prepare new events."""

    ticket: Ticket
    pending: bytes


@dataclass(frozen=True, slots=True)
class Replay:
    """A final verdict is recorded: answer `response` (the caller adds replayed:true)."""

    response: bytes


@dataclass(frozen=True, slots=True)
class Conflict:
    """Same key, different digest: request_id_conflict. The original record is untouched."""


Begin: TypeAlias = Fresh | Resume | Replay | Conflict


@dataclass(slots=True, eq=False)
class _Flight:
    """An owner in this process. Waiters with the same digest wait on `done`."""

    ticket: Ticket
    state: State
    has_pending: bool
    done: trio.Event = field(default_factory=trio.Event)
    #: set by finish(final=True), so waiters replay without a database round trip.
    final_response: bytes | None = None


@dataclass(frozen=True, slots=True)
class _Row:
    digest: bytes
    state: State
    pending: bytes | None
    response: bytes | None


_SCHEMA = """
CREATE TABLE IF NOT EXISTS ledger (
    principal   TEXT    NOT NULL,
    request_id  TEXT    NOT NULL,
    digest      BLOB    NOT NULL,
    state       TEXT    NOT NULL,
    pending     BLOB,
    response    BLOB,
    created_at  INTEGER NOT NULL,
    updated_at  INTEGER NOT NULL,
    PRIMARY KEY (principal, request_id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS ledger_by_age ON ledger (state, updated_at)
"""

_Op: TypeAlias = Callable[[sqlite3.Connection], Any]


class Ledger:
    """The durable idempotency ledger. Create with `Ledger.open(path, retention_seconds=...)`."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        reader: sqlite3.Connection,
        *,
        retention_seconds: int,
        clock: Callable[[], float],
    ) -> None:
        # Private: use Ledger.open(). Both connections are ours alone: `conn` writes from
        # worker threads, `reader` serves begin()'s lookup on the event-loop thread.
        # The write side: every write is an op in `_group`'s next transaction on `conn`.
        self._conn = conn
        self._group: GroupCommit[_Op, Any] = GroupCommit(
            self._run_batch, flush_failed=lambda: RuntimeError("ledger flush failed")
        )
        #: how many transactions (fsyncs) the flusher ran; the benchmark reports it.
        self.commits = 0
        # The read side and ownership: begin()'s lookup, and who owns which key.
        self._reader = reader
        self._inflight: dict[LedgerKey, _Flight] = {}
        self._retention = retention_seconds
        self._clock = clock
        self._closed = False

    @classmethod
    def open(
        cls,
        path: Path | str,
        *,
        retention_seconds: int,
        clock: Callable[[], float] = time.time,
    ) -> Ledger:
        """Open or create the ledger database file (normally `<state>/ledger.db`).

        Args:
            path: the database file (not the state directory).
            retention_seconds: how long final verdicts are kept (config
                `state.ledger_retention_seconds`, default 7 days).
            clock: seconds since the epoch, for the records' timestamps (tests inject it).

        Raises:
            ValueError: bad retention, or `path` is a directory.
            OSError / sqlite3.Error: the database cannot be opened.
        """
        if isinstance(retention_seconds, bool) or not isinstance(retention_seconds, int):
            raise TypeError("retention_seconds must be an int")
        if retention_seconds <= 0:
            raise ValueError("retention_seconds must be positive")
        conn = open_private_db(Path(path), _SCHEMA)
        try:
            reader = _open_reader(Path(path))
        except BaseException:
            conn.close()
            raise
        return cls(conn, reader, retention_seconds=retention_seconds, clock=clock)

    def close(self) -> None:
        """Close the connection. Call only when no request is in flight (daemon shutdown)."""
        if not self._closed:
            self._closed = True
            self._reader.close()
            self._conn.close()

    # -- group commit (daemon/_group_commit.py runs the queue) --------------------------

    async def _run(self, op: _Op) -> Any:
        """Queue `op` for the next transaction and wait until it is committed.

        Cancellation: if the waiting task is cancelled, its operation still runs in the
        next batch (it may already be in a transaction); the caller just stops waiting.
        """
        if self._closed:
            raise RuntimeError("ledger is closed")
        return await self._group.submit(op)

    def _run_batch(self, batch: Sequence[_Op]) -> list[Any]:
        # Runs in a worker thread. One transaction, one fsync, for the whole batch.
        conn = self._conn
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            return [Failed(exc)] * len(batch)
        results: list[Any] = []
        for op in batch:
            try:
                results.append(op(conn))
            except Exception as exc:  # noqa: BLE001 - handed back to the one caller it concerns
                results.append(Failed(exc))
        try:
            conn.execute("COMMIT")
            self.commits += 1
        except sqlite3.Error as exc:
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            # Nothing in this batch is durable: every caller learns it.
            return [r if isinstance(r, Failed) else Failed(exc) for r in results]
        return results

    # -- the protocol ----------------------------------------------------------------

    async def begin(self, key: LedgerKey, digest: bytes) -> Begin:
        """Decide what a request with this key and digest must do. See the module docstring.

        Returns:
            Fresh / Resume (the caller now owns the key: it must call finish() or
            release()), Replay, or Conflict.

        Raises:
            ValueError: the digest is not 32 bytes (our bug).
            sqlite3.Error: the database failed; nothing was claimed.

        Cancellation: a cancelled begin() owns nothing (any claim is released).
        """
        if not isinstance(digest, bytes) or len(digest) != DIGEST_BYTES:
            raise ValueError("ledger digest must be 32 bytes (sha256)")
        while True:
            flight = self._inflight.get(key)
            if flight is None:
                break
            if flight.ticket.digest != digest:
                return Conflict()
            await flight.done.wait()
            if flight.final_response is not None:
                return Replay(flight.final_response)
            # Ended indeterminate or released: loop, and the first waiter to run claims it.

        ticket = Ticket(key, digest)
        flight = _Flight(ticket, State.NEW, has_pending=False)
        # Claim before the lookup, so a concurrent begin() sees an owner. The lookup is
        # synchronous on the event loop (module docstring: why that is safe and cheap).
        self._inflight[key] = flight
        try:
            if self._closed:
                raise RuntimeError("ledger is closed")
            row = _select(self._reader, key)
        except BaseException:
            self._drop(flight)
            raise
        if row is None:
            return Fresh(ticket)
        if row.digest != digest:
            self._drop(flight)
            return Conflict()
        if row.state is State.FINAL:
            self._drop(flight)
            assert row.response is not None, "a final ledger record always holds a response"
            return Replay(row.response)
        flight.state = row.state
        if row.pending is not None:
            flight.has_pending = True
            return Resume(ticket, row.pending)
        return Fresh(ticket)

    async def record_pending(self, ticket: Ticket, pending: bytes) -> None:
        """Durably record the signed work BEFORE any of it reaches the relay.

        Returns only after the commit (WAL fsynced). Raises AssertionError if the ticket
        does not own its key or the key already holds pending work (write-once).
        """
        flight = self._owner(ticket)
        if not isinstance(pending, bytes):
            raise TypeError("pending must be bytes")
        if flight.has_pending:
            raise AssertionError("ledger: pending work is write-once; re-send the recorded work")
        new_state = advance(flight.state, LedgerEvent.RECORD_PENDING)
        now = int(self._clock())
        key, digest = ticket.key, ticket.digest

        def op(conn: sqlite3.Connection) -> None:
            conn.execute(
                "INSERT INTO ledger (principal, request_id, digest, state, pending, response,"
                " created_at, updated_at) VALUES (?, ?, ?, ?, ?, NULL, ?, ?)"
                " ON CONFLICT (principal, request_id) DO UPDATE SET"
                " state = excluded.state, pending = excluded.pending,"
                " updated_at = excluded.updated_at",
                (key.principal, key.request_id, digest, new_state.value, pending, now, now),
            )

        await self._run(op)
        flight.state = new_state
        flight.has_pending = True

    async def finish(self, ticket: Ticket, response: bytes, *, final: bool) -> None:
        """Record the verdict and end ownership; waiters wake.

        Args:
            response: the encoded broker_result, replayed verbatim (final) or kept for the
                record (indeterminate).
            final: True for succeeded/failed; False for indeterminate, which keeps the
                pending work so the next identical retry gets Resume.

        Raises:
            AssertionError: the ticket does not own its key, or the transition is illegal.
            sqlite3.Error: the commit failed; ownership is released (waiters look again).
        """
        flight = self._owner(ticket)
        if not isinstance(response, bytes):
            raise TypeError("response must be bytes")
        event = LedgerEvent.FINISH_FINAL if final else LedgerEvent.FINISH_INDETERMINATE
        new_state = advance(flight.state, event)
        now = int(self._clock())
        key, digest = ticket.key, ticket.digest

        def op(conn: sqlite3.Connection) -> None:
            conn.execute(
                "INSERT INTO ledger (principal, request_id, digest, state, pending, response,"
                " created_at, updated_at) VALUES (?, ?, ?, ?, NULL, ?, ?, ?)"
                " ON CONFLICT (principal, request_id) DO UPDATE SET"
                " state = excluded.state, response = excluded.response,"
                " updated_at = excluded.updated_at",
                (key.principal, key.request_id, digest, new_state.value, response, now, now),
            )

        try:
            await self._run(op)
        except BaseException:
            self._drop(flight)
            raise
        flight.state = new_state
        if final:
            flight.final_response = response
        self._drop(flight)

    def release(self, ticket: Ticket) -> None:
        """End ownership without a verdict (the owner was cancelled or crashed mid-way).

        Whatever was durably recorded stays; a waiter or a later retry looks again.
        Releasing a ticket that no longer owns its key is a no-op, so `finally:` blocks
        may call it unconditionally after finish().
        """
        flight = self._inflight.get(ticket.key)
        if flight is not None and flight.ticket is ticket:
            self._drop(flight)

    async def sweep(self, now: int) -> int:
        """Drop expired records; returns how many. Keys in flight are kept."""
        final_before = now - self._retention
        stale_before = now - STALE_FACTOR * self._retention
        busy = list(self._inflight)

        def op(conn: sqlite3.Connection) -> int:
            # A final record in flight cannot exist (final keys are never claimed).
            removed = conn.execute(
                "DELETE FROM ledger WHERE state = ? AND updated_at < ?",
                (State.FINAL.value, final_before),
            ).rowcount
            stale = conn.execute(
                "SELECT principal, request_id FROM ledger WHERE state != ? AND updated_at < ?",
                (State.FINAL.value, stale_before),
            ).fetchall()
            # An owner in this process may be about to finish a stale key: keep it.
            busy_set = {(k.principal, k.request_id) for k in busy}
            doomed = [row for row in stale if (row[0], row[1]) not in busy_set]
            conn.executemany(
                "DELETE FROM ledger WHERE principal = ? AND request_id = ?", doomed
            )
            return int(removed) + len(doomed)

        removed: int = await self._run(op)
        return removed

    async def count(self) -> int:
        """How many records the database holds (for tests, metrics and the benchmark)."""
        n: int = await self._run(
            lambda conn: conn.execute("SELECT count(*) FROM ledger").fetchone()[0]
        )
        return n

    # -- ownership ---------------------------------------------------------------------

    def _owner(self, ticket: Ticket) -> _Flight:
        flight = self._inflight.get(ticket.key)
        if flight is None or flight.ticket is not ticket:
            raise AssertionError("ledger: this ticket does not own its key (finished or released)")
        return flight

    def _drop(self, flight: _Flight) -> None:
        if self._inflight.get(flight.ticket.key) is flight:
            del self._inflight[flight.ticket.key]
        flight.done.set()


def _open_reader(path: Path) -> sqlite3.Connection:
    """The read-only connection for begin() (the writer already made the file and schema)."""
    reader = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
    try:
        reader.execute(f"PRAGMA busy_timeout={READ_BUSY_TIMEOUT_MS}")
        # Belt and braces: this connection can never write, whatever a bug asks of it.
        reader.execute("PRAGMA query_only=ON")
    except BaseException:
        reader.close()
        raise
    return reader


def _select(conn: sqlite3.Connection, key: LedgerKey) -> _Row | None:
    row = conn.execute(
        "SELECT digest, state, pending, response FROM ledger"
        " WHERE principal = ? AND request_id = ?",
        (key.principal, key.request_id),
    ).fetchone()
    if row is None:
        return None
    return _Row(digest=bytes(row[0]), state=State(row[1]), pending=row[2], response=row[3])
