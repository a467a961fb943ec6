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
       the caller checks the credential again after such a wait (`joins`): the ledger
       hands over whatever it holds, and authorizing its release is the caller's;
    3. no record -> a tombstone with the same digest -> `Forgotten()`, with another ->
       `Conflict()`; else `Fresh(ticket)` (or `Full()` at a cap); a record with another
       digest -> `Conflict()` (the record is untouched); a final record ->
       `Replay(response)`; a rolled-back record -> `RolledBack(ticket, ...)` (never
       `Resume`: its rollback may have run); a pending or indeterminate record that holds
       pending work -> `Resume(ticket, pending)`; an indeterminate record without pending
       work (nothing was ever sent; perhaps reserved) -> `Fresh(ticket, recorded=True)`.
  Whoever receives a ticket owns the key in this process until `finish()` or `release()`.
- `record_pending` commits before it returns (synchronous=FULL) — the caller must not let
  anything reach the relay before it returns. The pending blob is write-once: a retry
  re-sends exactly those events, never re-signed ones.
- `roll_back(ticket, response, status, code)` commits the `failed` verdict of pending work
  the relay refused at its first event, on a fresh attempt, BEFORE the rollback's effects
  run (agents.create: destroying the key). From that commit on the record is ROLLED_BACK:
  its events are never sent again, whatever happens to the rest of the request. A retry
  gets `RolledBack`: it runs the rollback again (each step is safe twice) and records the
  stored verdict final. An indeterminate `finish` of a rolled-back record writes nothing
  (the rollback could not be finished: the next retry tries again).
- `finish(ticket, response, status, code)` records a verdict: its bytes (opaque: the
  ledger never reads them) and its status and code as columns, which a replay hands back
  beside the bytes (the log and metrics need them; nothing parses them back out of the
  bytes). succeeded and failed are the one state FINAL; indeterminate is never final, it
  keeps the pending blob, and the next identical retry gets `Resume`.
- States move only through `advance(state, event)`, one lookup in `TRANSITIONS`; a missing
  pair is our bug (AssertionError naming state and event).

I/O: SQLite in WAL mode. Writes go through one dedicated connection, used only from trio
worker threads under this ledger's own CapacityLimiter(1). Group commit (the engine is
daemon/state/_group_commit.py, shared with the audit log): every write is queued as an
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

Retention: every record carries the time it `expires`: a final verdict `retention_seconds`
after it was recorded (or the shorter `keep_seconds` the caller passes: reads), a
pending/indeterminate one `STALE_FACTOR` x retention after its last write. `sweep(now)`
deletes what has expired by `now`. Keys in flight are never swept. Which `now` the daemon
may believe is daemon/state/sweep_clock.py's question (a wall clock read ahead would sweep
what has not expired); `newest_record_time`, read at open, is its reference. Tombstones
(issue 23 item 7, NIP-BA's retry protection): a record that may stand for an effect —
pending work, an indeterminate verdict, a `reserve`d key, or a final verdict the caller
marks `tombstone` (an action with effects that ran) — writes (K, 16 bytes of D) into
`tombstones` in the same transaction; the sweep never deletes them, so such a requestId is
never new again. A record without one (a refusal before execution, a read) is forgotten: a
retry that late runs.

Disk (issue 13): a record is stored compactly. The principal is a small integer
(`principals` table), the requestId its 16-byte `request_key` (sha256, truncated: the key
must be exact, the text is not needed — the caller holds it on every lookup, and the
audit log has it), and one index (by expiry) beside the primary key. `entries` is a rowid
table (`_ENTRIES_DDL`: a WITHOUT ROWID row over ~1 KB took a 4 KiB overflow page of its
own, and a published record is often that; a file made before keeps that table while
it is too big to move at open, `_migrate_rowid`). A refusal's response
is whatever compact bytes the caller hands in (daemon/state/verdict_store.py). Per account,
the ledger counts `ROW_BYTES` + its blobs for every record; at `max_bytes_per_principal` a
request that would add a record gets `Full()` (the pipeline refuses it, unrecorded). The
account of a principal `A/sub` (the records the pipeline keeps apart for one credential
of agent A) is `A`'s: one agent's records share one cap however they are keyed. A record
`finish`ed with `refusal_of=<credential>` is charged instead to the account `A/<credential>`
(its `charge` column), capped by `max_refusal_bytes_per_credential` (issue 22 M1): a
credential's refusals fill its own share, never its agent's. Tombstones count
`TOMBSTONE_BYTES` each against `A`. Replays and resumed work add nothing and are never
refused.

Audit anchor (issue 13): the audit log's head (seq, hash) is written into `audit_anchor`
in every transaction, when it has moved, so the verdict and the audit record it followed
become durable together. The audit log at start must reach it (daemon/state/audit.py).

Migrations: `_migrate_v1` moves the first layout's table in; `_migrate_verdict_columns`
adds `status` and `code` to a file made before they were columns; `_migrate_rowid` moves a
WITHOUT ROWID `entries` into the rowid one (last: it copies every column the others add),
only when that is cheap and the disk has room (`MOVE_AT_OPEN_MAX_BYTES`,
`MOVE_FREE_DISK_FACTOR`): otherwise the old table stays, read and written by the same
queries, and `Ledger.layout_kept` says why (the daemon logs it; this module does not log).

WARNING: one process owns a ledger file. The in-flight map is per process; a second daemon
on the same file would not see the first one's owners. Keep `TRANSITIONS`, the `State`
values stored in SQLite, `_SCHEMA`, `_ENTRIES_COLUMNS` and `_migrate_v1` in sync.
"""

from __future__ import annotations

import enum
import hashlib
import os
import re
import sqlite3
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, TypeAlias, TypeVar, cast

import trio

from buzzwire.contract import ErrorCode, Status
from daemon.state._group_commit import Failed, GroupCommit
from daemon.state._sqlite import open_private_db, transaction
from daemon.state.verdict_store import verdict_of

__all__ = [
    "LedgerKey",
    "Ledger",
    "Ticket",
    "Fresh",
    "Resume",
    "RolledBack",
    "Replay",
    "Conflict",
    "Full",
    "Forgotten",
    "Begin",
    "State",
    "LedgerEvent",
    "TRANSITIONS",
    "advance",
    "DIGEST_BYTES",
    "STALE_FACTOR",
    "LEDGER_FILENAME",
    "READ_BUSY_TIMEOUT_MS",
    "ROW_BYTES",
    "TOMBSTONE_BYTES",
    "request_key",
    "read_anchor",
    "write_anchor",
    "read_record",
    "KeptLayout",
    "KeptReason",
    "MOVE_AT_OPEN_MAX_BYTES",
    "MOVE_FREE_DISK_FACTOR",
    "OLD_ROW_BYTES",
    "free_disk_bytes",
]

#: The file name under the state directory (design.md: `<state>/ledger.db`).
LEDGER_FILENAME: Final = "ledger.db"

#: sha256 of the received body bytes (spec I3).
DIGEST_BYTES: Final = 32

#: Pending and indeterminate records are kept this many retention periods before a sweep
#: may drop them: they are the only memory of events that may be on the relay, so they
#: outlive final verdicts; but the database must stay bounded, so not forever.
STALE_FACTOR: Final = 2

#: What one record costs beyond its blobs, as the per-principal cap counts it: the key,
#: digest, state and expiry, the expiry index entry and B-tree slack (measured on a
#: table of refusals: ~150 bytes of file per record; rounded up).
ROW_BYTES: Final = 160

#: What one tombstone costs against its agent's cap: (principal id, request key, 16 bytes
#: of the body digest) in a WITHOUT ROWID table, with B-tree slack (measured by
#: tests/ledger/test_tombstones.py::test_a_tombstone_costs_tens_of_bytes; rounded up).
TOMBSTONE_BYTES: Final = 64

#: Bytes of sha256(body) a tombstone keeps: as the request key, 128 bits, so another body
#: passes for the identical one only by a ~2^64 effort of the principal against itself,
#: and what it would win is an `indeterminate` answer, never an execution.
TOMBSTONE_DIGEST_BYTES: Final = 16

#: Bytes of sha256(requestId) kept as the key: 128 bits, so two requestIds of one
#: principal collide only by a ~2^64 effort of that principal against itself.
REQUEST_KEY_BYTES: Final = 16

#: The most `_migrate_rowid` moves at open, as its estimate counts it (`OLD_ROW_BYTES` a
#: record plus its blobs: an upper bound on the old table's pages it reads, and on the new
#: table it writes). Measured under load, 944 MB of old table moved in 30 s (~31 MB/s), so
#: this is ~8 s of the 60 s systemd gives the start (TimeoutStartSec, READY after the ledger
#: opens): a bigger move could be killed mid-way at every start, rolled back each time.
MOVE_AT_OPEN_MAX_BYTES: Final = 256 * 1024 * 1024

#: What one WITHOUT ROWID record may take beyond its blobs: a 4 KiB overflow page it only
#: partly fills (a row over ~1 KB keeps the rest in pages of its own) and its key, digest,
#: expiry and index entry (ROW_BYTES). The measured 944 MB of 200,000 records of ~1.2 KB
#: is 4.7 KB a record; the estimate counts 5.5 KB for one (4,256 bytes and ~1.2 KB of blobs).
OLD_ROW_BYTES: Final = 4096 + ROW_BYTES

#: Free disk the move needs, in estimates: the new table is written to the WAL and the file,
#: and the old one's pages go through the WAL again as they are freed (SQLite built with
#: secure_delete zeroes each; measured: a 1.23 GB WAL for the 944 MB table) until the
#: commit; a review measured up to 1.44x two estimates for records of 60 KB at the commit.
#: A disk that fills anyway (SQLITE_FULL) keeps the old table too (`_migrate_rowid`).
MOVE_FREE_DISK_FACTOR: Final = 3

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
    #: The relay refused the pending work's first event on a fresh attempt: `failed` is
    #: stored, the events are never sent again, the rollback may not have finished.
    ROLLED_BACK = "rolled_back"
    #: succeeded or failed: replayed verbatim from now on.
    FINAL = "final"


class LedgerEvent(enum.Enum):
    """What an owner reports about its execution."""

    RECORD_PENDING = "record_pending"
    #: the request is about to make an effect outside the ledger (agents.create mints a
    #: key): the record must exist first, so that effect is bound to it (issue 22 H1).
    RESERVE = "reserve"
    FINISH_FINAL = "finish_final"
    FINISH_INDETERMINATE = "finish_indeterminate"
    #: the relay refused the first event of fresh pending work: its failed verdict is
    #: stored before the rollback runs (`Ledger.roll_back`).
    ROLL_BACK = "roll_back"


#: (state, event) -> next state. A pair that is absent is a programming error in the
#: pipeline (e.g. recording a verdict over a final one, or replacing pending work).
TRANSITIONS: Final[Mapping[tuple[State, LedgerEvent], State]] = {
    # A fresh request either plans side effects (pending first) or ends at once
    # (a read, a refusal, a fault before dispatch).
    (State.NEW, LedgerEvent.RECORD_PENDING): State.PENDING,
    (State.NEW, LedgerEvent.RESERVE): State.INDETERMINATE,
    (State.INDETERMINATE, LedgerEvent.RESERVE): State.INDETERMINATE,
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
    # Pending work the relay refused at its first event: the failed verdict is durable
    # before the rollback runs, and the work is never resumed. The rollback finished, the
    # verdict is final; it could not be (indeterminate), the record stays as it is.
    (State.PENDING, LedgerEvent.ROLL_BACK): State.ROLLED_BACK,
    (State.ROLLED_BACK, LedgerEvent.FINISH_FINAL): State.FINAL,
    (State.ROLLED_BACK, LedgerEvent.FINISH_INDETERMINATE): State.ROLLED_BACK,
}


def advance(state: State, event: LedgerEvent) -> State:
    """The one state-machine step. Raises AssertionError (our bug) on a forbidden pair."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise AssertionError(f"ledger: {event.name} is not allowed in state {state.name}") from None


def account_of(principal: str) -> str:
    """The account whose cap a principal's records count against (module docstring)."""
    return principal.partition("/")[0]


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
    """Run the request: nothing durable exists for it (or nothing was ever sent).

    `recorded`: an earlier attempt left a record without pending work (it reserved the
    key, or ended indeterminate before sending): whatever it made outside the ledger (a
    minted key) is this record's own. False: this requestId has no history here."""

    ticket: Ticket
    recorded: bool = False


@dataclass(frozen=True, slots=True)
class Resume:
    """Finish the request by re-sending exactly `pending`; never prepare new events."""

    ticket: Ticket
    pending: bytes


@dataclass(frozen=True, slots=True)
class RolledBack:
    """The relay refused this record's first event and its `failed` verdict is stored, but
    the rollback may not have finished (`Ledger.roll_back`). Run the rollback of `pending`
    again, then record `response` final; never send `pending`'s events."""

    ticket: Ticket
    pending: bytes
    response: bytes
    status: Status
    code: ErrorCode | None = None


@dataclass(frozen=True, slots=True)
class Replay:
    """A final verdict is recorded: answer `response` (the caller adds replayed:true).

    `status` and `code` are the verdict's, as recorded beside the bytes."""

    response: bytes
    status: Status
    code: ErrorCode | None = None


@dataclass(frozen=True, slots=True)
class Conflict:
    """Same key, different digest: request_id_conflict. The original record is untouched."""


@dataclass(frozen=True, slots=True)
class Full:
    """No record exists and an account is at its cap: nothing was claimed.

    `credential`: the credential's refusal share is full (only it is turned away), not the
    agent's account."""

    credential: bool = False


@dataclass(frozen=True, slots=True)
class Forgotten:
    """Only a tombstone is left of this key, with the same digest: the request ran (or may
    have) and its verdict is gone. Answer indeterminate + outcome_unknown; never run it."""


Begin: TypeAlias = Fresh | Resume | RolledBack | Replay | Conflict | Full | Forgotten


class KeptReason(enum.Enum):
    """Why `_migrate_rowid` left the WITHOUT ROWID `entries` as it was at this open."""

    #: the estimate is over MOVE_AT_OPEN_MAX_BYTES: the move could outlast the start.
    TOO_MANY_RECORDS = "too_many_records"
    #: the ledger's file system has less free than MOVE_FREE_DISK_FACTOR x the estimate.
    NOT_ENOUGH_FREE_DISK = "not_enough_free_disk"


@dataclass(frozen=True, slots=True)
class KeptLayout:
    """The old layout stays (`Ledger.layout_kept`): why, and the figures that decided it.

    `move_bytes` is the estimate (None when the count alone was over the bound: the sum of
    the blobs was not read); `free_bytes` is None when the disk was not asked."""

    reason: KeptReason
    records: int
    move_bytes: int | None
    free_bytes: int | None


def free_disk_bytes(directory: Path) -> int:
    """Bytes an unprivileged writer may still use on `directory`'s file system."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def request_key(request_id: str) -> bytes:
    """The stored form of a requestId (module docstring: why a hash)."""
    return hashlib.sha256(request_id.encode("utf-8")).digest()[:REQUEST_KEY_BYTES]


@dataclass(slots=True, eq=False)
class _Flight:
    """An owner in this process. Waiters with the same digest wait on `done`."""

    ticket: Ticket
    state: State
    has_pending: bool
    done: trio.Event = field(default_factory=trio.Event)
    #: set by a final finish(), so waiters replay without a database round trip.
    final: Replay | None = None
    #: this owner recorded the pending work itself (not a resumed record, whose events an
    #: earlier attempt may have sent): only such work may be rolled back.
    recorded_here: bool = False


@dataclass(frozen=True, slots=True)
class _Row:
    digest: bytes
    state: State
    pending: bytes | None
    response: bytes | None
    status: str | None
    code: str | None


#: The records. An ordinary rowid table, (pid, rid) unique through its primary-key index:
#: SQLite keeps a row of up to ~4 KB in a rowid table's leaf page, but at most ~1 KB of a
#: WITHOUT ROWID one's (an index b-tree's local limit), the rest in a 4 KiB overflow page
#: of its own, so a published record (pending events and a verdict, often over 1 KB) cost
#: 2-4x the bytes the cap counts (`_migrate_rowid` moves that layout's records in).
#: `{name}`: the table's name (the migration builds it under another, then renames it).
_ENTRIES_DDL: Final = """
CREATE TABLE IF NOT EXISTS {name} (
    pid         INTEGER NOT NULL,
    rid         BLOB    NOT NULL,
    digest      BLOB    NOT NULL,
    state       TEXT    NOT NULL,
    pending     BLOB,
    response    BLOB,
    status      TEXT,
    code        TEXT,
    expires     INTEGER NOT NULL,
    charge      INTEGER,
    PRIMARY KEY (pid, rid)
)"""

#: Every column of `entries`, in its order (what `_migrate_rowid` copies).
_ENTRIES_COLUMNS: Final = ("pid, rid, digest, state, pending, response, status, code,"
                           " expires, charge")

_EXPIRY_INDEX_DDL: Final = "CREATE INDEX IF NOT EXISTS entries_by_expiry ON entries (expires)"

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS principals (
    id          INTEGER PRIMARY KEY,
    principal   TEXT    NOT NULL UNIQUE
);
{_ENTRIES_DDL.format(name="entries")};
{_EXPIRY_INDEX_DDL};
CREATE TABLE IF NOT EXISTS tombstones (
    pid         INTEGER NOT NULL,
    rid         BLOB    NOT NULL,
    digest      BLOB    NOT NULL,
    PRIMARY KEY (pid, rid)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS audit_anchor (
    id          INTEGER PRIMARY KEY CHECK (id = 1),
    seq         INTEGER NOT NULL,
    head        TEXT    NOT NULL
)
"""

#: The size a record counts against its principal's cap (SQL over an `entries` row).
_SIZE_SQL = f"{ROW_BYTES} + coalesce(length(pending), 0) + coalesce(length(response), 0)"

_Op: TypeAlias = Callable[[sqlite3.Connection], object]
_T = TypeVar("_T")


class Ledger:
    """The durable idempotency ledger. Create with `Ledger.open(path, retention_seconds=...)`."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        reader: sqlite3.Connection,
        *,
        retention_seconds: int,
        max_bytes_per_principal: int | None,
        max_refusal_bytes_per_credential: int | None,
        clock: Callable[[], float],
        layout_kept: KeptLayout | None = None,
    ) -> None:
        # Private: use Ledger.open(). Both connections are ours alone: `conn` writes from
        # worker threads, `reader` serves begin()'s lookup on the event-loop thread.
        # The write side: every write is an op in `_group`'s next transaction on `conn`.
        self._conn = conn
        self._group: GroupCommit[_Op, object] = GroupCommit(
            self._run_batch, flush_failed=lambda: RuntimeError("ledger flush failed")
        )
        #: how many transactions (fsyncs) the flusher ran; the benchmark reports it.
        self.commits = 0
        # The read side and ownership: begin()'s lookup, and who owns which key.
        self._reader = reader
        self._inflight: dict[LedgerKey, _Flight] = {}
        self._retention = retention_seconds
        self._max_bytes = max_bytes_per_principal
        self._max_refusal_bytes = max_refusal_bytes_per_credential
        self._clock = clock
        self._closed = False
        # principal -> id, and id -> counted bytes. Written only by the flusher thread
        # (inside a transaction), read on the event loop: a stale read is off by the
        # records of one batch, which the cap tolerates.
        self._pids: dict[str, int] = dict(
            conn.execute("SELECT principal, id FROM principals").fetchall())
        self._names: dict[int, str] = {pid: name for name, pid in self._pids.items()}
        self._usage: dict[str, int] = {}
        written: list[int] = []
        # The same scan reads when the newest record was written, from its expiry: a final
        # one expires at most the retention after (reads and refusals may keep less, so
        # this can only be early), a pending/indeterminate one exactly STALE_FACTOR x it.
        for pid, charge, size, newest in conn.execute(
                f"SELECT pid, charge, total({_SIZE_SQL}),"
                " max(expires - CASE state WHEN ? THEN ? ELSE ? END)"
                " FROM entries GROUP BY pid, charge",
                (State.FINAL.value, retention_seconds, STALE_FACTOR * retention_seconds),
        ).fetchall():
            account = self._account(int(pid), None if charge is None else int(charge))
            self._usage[account] = self._usage.get(account, 0) + int(size)
            written.append(int(newest))
        #: When the newest record was written, as of opening (None: no record): never
        #: later than that, perhaps earlier (unless the retention was shortened since: then
        #: later, and the sweep's clock believes the wall clock at once, as it always did).
        #: daemon/state/sweep_clock.py starts from it.
        self.newest_record_time: int | None = max(written, default=None)
        for pid, count in conn.execute(
                "SELECT pid, count(*) FROM tombstones GROUP BY pid").fetchall():
            account = self._account(int(pid), None)
            self._usage[account] = self._usage.get(account, 0) + TOMBSTONE_BYTES * int(count)
        # Made in the running transaction; joined to `_pids` / `_usage` only once it
        # commits (a rolled-back id could otherwise be handed to another principal).
        self._new_pids: dict[str, int] = {}
        self._deltas: dict[str, int] = {}
        # The audit head to anchor (daemon/state/audit.py), and the one the database holds.
        self._head_source: Callable[[], tuple[int, str]] | None = None
        self._anchored = self._read_anchor(conn)
        #: None: `entries` is the rowid table. Else the WITHOUT ROWID one stayed at this
        #: open, and why (the daemon's start logs it once): it works as before, a record
        #: over ~1 KB still taking a 4 KiB page of its own, and a later open may move it.
        self.layout_kept = layout_kept

    @classmethod
    def open(
        cls,
        path: Path | str,
        *,
        retention_seconds: int,
        max_bytes_per_principal: int | None = None,
        max_refusal_bytes_per_credential: int | None = None,
        clock: Callable[[], float] = time.time,
        free_bytes: Callable[[Path], int] = free_disk_bytes,
    ) -> Ledger:
        """Open or create the ledger database file (normally `<state>/ledger.db`).

        Args:
            path: the database file (not the state directory).
            retention_seconds: how long final verdicts are kept (config
                `state.ledger_retention_seconds`, default 7 days).
            max_bytes_per_principal: the cap on one principal's records (config
                `state.ledger_max_bytes_per_agent`); None = no cap.
            max_refusal_bytes_per_credential: the cap on one credential's refusal
                records, kept apart from its agent's account (config
                `state.ledger_max_refusal_bytes_per_credential`); None = no cap.
            clock: seconds since the epoch, for the records' timestamps (tests inject it).
            free_bytes: free bytes on a directory's file system, asked of the file's
                directory before moving an old layout (`_migrate_rowid`; tests inject it).

        Raises:
            ValueError: bad retention or cap, or `path` is a directory.
            OSError / sqlite3.Error: the database cannot be opened.
        """
        if isinstance(retention_seconds, bool) or not isinstance(retention_seconds, int):
            raise TypeError("retention_seconds must be an int")
        if retention_seconds <= 0:
            raise ValueError("retention_seconds must be positive")
        if max_bytes_per_principal is not None and (
                isinstance(max_bytes_per_principal, bool)
                or not isinstance(max_bytes_per_principal, int)
                or max_bytes_per_principal <= 0):
            raise ValueError("max_bytes_per_principal must be a positive int or None")
        if max_refusal_bytes_per_credential is not None and (
                isinstance(max_refusal_bytes_per_credential, bool)
                or not isinstance(max_refusal_bytes_per_credential, int)
                or max_refusal_bytes_per_credential <= 0):
            raise ValueError("max_refusal_bytes_per_credential must be a positive int or None")
        conn = open_private_db(Path(path), _SCHEMA)
        try:
            moved = _migrate_v1(conn, retention_seconds)
            _migrate_verdict_columns(conn, backfill=moved)
            _migrate_charge_column(conn)
            kept = _migrate_rowid(conn, lambda: free_bytes(Path(path).parent))
            reader = _open_reader(Path(path))
        except BaseException:
            conn.close()
            raise
        try:
            return cls(conn, reader, retention_seconds=retention_seconds,
                       max_bytes_per_principal=max_bytes_per_principal,
                       max_refusal_bytes_per_credential=max_refusal_bytes_per_credential,
                       clock=clock, layout_kept=kept)
        except BaseException:
            reader.close()
            conn.close()
            raise

    def close(self) -> None:
        """Close the connection. Call only when no request is in flight (daemon shutdown)."""
        if not self._closed:
            self._closed = True
            self._reader.close()
            self._conn.close()

    # -- the audit anchor ----------------------------------------------------------------

    def anchor_audit(self, head: Callable[[], tuple[int, str]]) -> None:
        """From now on every transaction records `head()` when it has moved.

        `head` is called from the flusher thread: it must be thread-safe and must never
        name a record that is not durable yet (AuditLog.head is both).
        """
        self._head_source = head

    @property
    def audit_anchor(self) -> tuple[int, str] | None:
        """The anchored audit head (seq, hash), or None when none was ever recorded."""
        return self._anchored

    async def anchor(self) -> None:
        """Commit the audit head now if it moved (after a verdict the ledger did not record)."""
        if self._head_source is not None and self._head_source() != self._anchored:
            await self._run(lambda conn: None)

    @staticmethod
    def _read_anchor(conn: sqlite3.Connection) -> tuple[int, str] | None:
        row = conn.execute("SELECT seq, head FROM audit_anchor WHERE id = 1").fetchone()
        return None if row is None else (int(row[0]), str(row[1]))

    # -- group commit (daemon/state/_group_commit.py runs the queue) --------------------------

    async def _run(self, op: Callable[[sqlite3.Connection], _T]) -> _T:
        """Queue `op` for the next transaction and wait until it is committed; its result.

        Cancellation: if the waiting task is cancelled, its operation still runs in the
        next batch (it may already be in a transaction); the caller just stops waiting.
        """
        if self._closed:
            raise RuntimeError("ledger is closed")
        # The group hands each op back its own result: the type `op` returns.
        return cast(_T, await self._group.submit(op))

    def _run_batch(self, batch: Sequence[_Op]) -> list[object]:
        # Runs in a worker thread. One transaction, one fsync, for the whole batch.
        conn = self._conn
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            return [Failed(exc)] * len(batch)
        # Usage and new ids count only when the transaction commits; an op that fails is
        # rolled back to its savepoint, with what it noted here.
        self._deltas, self._new_pids = {}, {}
        results: list[object] = []
        for index, op in enumerate(batch):
            noted = dict(self._deltas), dict(self._new_pids)
            try:
                conn.execute("SAVEPOINT op")
                results.append(op(conn))
                conn.execute("RELEASE op")
            except Exception as exc:  # noqa: BLE001 - handed back to the one caller it concerns
                self._deltas, self._new_pids = noted
                if not conn.in_transaction:
                    # SQLite rolled back the whole transaction (SQLITE_FULL, IOERR or NOMEM
                    # inside a statement may), not just this op: the ops before it are gone
                    # too, and a later op's SAVEPOINT would open a transaction of its own
                    # and commit it at its RELEASE, durable while its caller hears
                    # "failed". So nothing in this batch is durable and the rest never run;
                    # none of its usage or new ids count.
                    self._deltas, self._new_pids = {}, {}
                    lost: list[object] = [r if isinstance(r, Failed) else Failed(exc)
                                          for r in results]
                    return lost + [Failed(exc)] * (len(batch) - index)
                try:
                    conn.execute("ROLLBACK TO op")
                    conn.execute("RELEASE op")
                except sqlite3.Error:
                    pass
                results.append(Failed(exc))
        head = self._head_source() if self._head_source is not None else None
        try:
            if head is not None and head != self._anchored:
                conn.execute(
                    "INSERT INTO audit_anchor (id, seq, head) VALUES (1, ?, ?)"
                    " ON CONFLICT (id) DO UPDATE SET seq = excluded.seq, head = excluded.head",
                    head)
            conn.execute("COMMIT")
            self.commits += 1
        except sqlite3.Error as exc:
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            # Nothing in this batch is durable: every caller learns it.
            return [r if isinstance(r, Failed) else Failed(exc) for r in results]
        if head is not None:
            self._anchored = head
        self._pids.update(self._new_pids)
        self._names.update((pid, name) for name, pid in self._new_pids.items())
        for account, delta in self._deltas.items():
            self._usage[account] = max(0, self._usage.get(account, 0) + delta)
        return results

    def _account(self, pid: int, charge: int | None) -> str:
        """Whose cap a record counts against: its agent's, or the credential's refusal
        share it is charged to (`A/<credential>`, kept apart from `A`)."""
        if charge is not None:
            return self._names.get(charge) or self._new_name(charge)
        return account_of(self._names.get(pid) or self._new_name(pid))

    def _new_name(self, pid: int) -> str:
        # A principal made in the running transaction (flusher thread only).
        return next(name for name, new in self._new_pids.items() if new == pid)

    def _charge(self, account: str, size: int) -> None:
        self._deltas[account] = self._deltas.get(account, 0) + size

    def _pid(self, conn: sqlite3.Connection, principal: str) -> int:
        """The principal's id, made in this transaction if new (flusher thread only)."""
        pid = self._pids.get(principal)
        if pid is None:
            conn.execute("INSERT OR IGNORE INTO principals (principal) VALUES (?)", (principal,))
            pid = int(conn.execute("SELECT id FROM principals WHERE principal = ?",
                                   (principal,)).fetchone()[0])
            self._new_pids[principal] = pid
        return pid

    def _upsert(self, conn: sqlite3.Connection, key: LedgerKey, digest: bytes, state: State,
                expires: int, *, pending: bytes | None = None,
                response: bytes | None = None, status: Status | None = None,
                code: ErrorCode | None = None, charge: str | None = None,
                tombstone: bool = False) -> None:
        """Write one record (flusher thread); counts its size change for the caps.

        `charge`: the refusal account that pays for it (None: the agent's). `tombstone`:
        keep (K, D) once the record expires; written now, in the same transaction, so no
        crash can leave a claimed key without one."""
        pid = self._pid(conn, key.principal)
        charge_pid = None if charge is None else self._pid(conn, charge)
        rid = request_key(key.request_id)
        old = conn.execute(f"SELECT {_SIZE_SQL}, charge FROM entries WHERE pid = ? AND rid = ?",
                           (pid, rid)).fetchone()
        # A column given as None keeps what the record holds (pending is write-once;
        # an indeterminate response stays until the verdict replaces it).
        conn.execute(
            "INSERT INTO entries (pid, rid, digest, state, pending, response, status, code,"
            " expires, charge) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT (pid, rid) DO UPDATE SET state = excluded.state,"
            " pending = coalesce(excluded.pending, pending),"
            " response = coalesce(excluded.response, response),"
            " status = CASE WHEN excluded.response IS NULL THEN status ELSE excluded.status END,"
            " code = CASE WHEN excluded.response IS NULL THEN code ELSE excluded.code END,"
            " expires = excluded.expires, charge = excluded.charge",
            (pid, rid, digest, state.value, pending, response,
             None if status is None else status.value, None if code is None else code.value,
             expires, charge_pid),
        )
        new = conn.execute(f"SELECT {_SIZE_SQL} FROM entries WHERE pid = ? AND rid = ?",
                           (pid, rid)).fetchone()
        if old is not None:
            self._charge(self._account(pid, old[1]), -int(old[0]))
        self._charge(self._account(pid, charge_pid), int(new[0]))
        if tombstone and conn.execute(
                "INSERT OR IGNORE INTO tombstones (pid, rid, digest) VALUES (?, ?, ?)",
                (pid, rid, digest[:TOMBSTONE_DIGEST_BYTES])).rowcount == 1:
            self._charge(self._account(pid, None), TOMBSTONE_BYTES)

    # -- the protocol ----------------------------------------------------------------

    async def begin(self, key: LedgerKey, digest: bytes, *,
                    credential: str | None = None) -> Begin:
        """Decide what a request with this key and digest must do. See the module docstring.

        `credential`: the credential presented; its refusal share is checked with the
        agent's account before a new record is claimed.

        Returns:
            Fresh / Resume (the caller now owns the key: it must call finish() or
            release()), Replay, Conflict, Forgotten (only a tombstone is left), or Full
            (no record, and an account is at its cap: nothing claimed, nothing recorded).

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
            if flight.final is not None:
                return flight.final
            # Ended indeterminate or released: loop, and the first waiter to run claims it.

        ticket = Ticket(key, digest)
        flight = _Flight(ticket, State.NEW, has_pending=False)
        # Claim before the lookup, so a concurrent begin() sees an owner. The lookup is
        # synchronous on the event loop (module docstring: why that is safe and cheap).
        self._inflight[key] = flight
        try:
            if self._closed:
                raise RuntimeError("ledger is closed")
            pid = self._pids.get(key.principal)
            row = None if pid is None else _select(self._reader, pid, key)
        except BaseException:
            self._drop(flight)
            raise
        if row is None:
            answer = self._unrecorded(key, digest, pid, credential)
            if answer is not None:
                self._drop(flight)
                return answer
            return Fresh(ticket)
        if row.digest != digest:
            self._drop(flight)
            return Conflict()
        if row.state is State.FINAL:
            self._drop(flight)
            assert row.response is not None and row.status is not None, (
                "a final ledger record always holds a response and its status")
            return Replay(row.response, Status(row.status),
                          None if row.code is None else ErrorCode(row.code))
        flight.state = row.state
        if row.state is State.ROLLED_BACK:
            assert (row.pending is not None and row.response is not None
                    and row.status is not None), "a rolled-back record holds its work and verdict"
            flight.has_pending = True
            return RolledBack(ticket, row.pending, row.response, Status(row.status),
                              None if row.code is None else ErrorCode(row.code))
        if row.pending is not None:
            flight.has_pending = True
            return Resume(ticket, row.pending)
        return Fresh(ticket, recorded=True)

    def _unrecorded(self, key: LedgerKey, digest: bytes, pid: int | None,
                    credential: str | None) -> Begin | None:
        """No record: what a tombstone or a full account answers, or None (a fresh key)."""
        kept = None if pid is None else self._reader.execute(
            "SELECT digest FROM tombstones WHERE pid = ? AND rid = ?",
            (pid, request_key(key.request_id))).fetchone()
        if kept is not None:
            return Forgotten() if bytes(kept[0]) == digest[:TOMBSTONE_DIGEST_BYTES] else Conflict()
        agent = account_of(key.principal)
        if self._max_bytes is not None and self._usage.get(agent, 0) >= self._max_bytes:
            return Full()
        if (credential is not None and self._max_refusal_bytes is not None
                and self._usage.get(f"{agent}/{credential}", 0) >= self._max_refusal_bytes):
            return Full(credential=True)
        return None

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
        expires = int(self._clock()) + STALE_FACTOR * self._retention
        key, digest = ticket.key, ticket.digest
        await self._run(lambda conn: self._upsert(conn, key, digest, new_state, expires,
                                                  pending=pending, tombstone=True))
        flight.state = new_state
        flight.has_pending = True
        flight.recorded_here = True

    async def roll_back(self, ticket: Ticket, response: bytes, status: Status,
                        code: ErrorCode | None = None) -> None:
        """Durably mark pending work rolled back, with its `failed` verdict, BEFORE the
        rollback's effects run (module docstring). Ownership is kept: `finish` follows.

        Raises:
            AssertionError: the ticket does not own its key, this owner did not record the
              pending work itself (a resumed record is never rolled back), or the verdict
              is not `failed`.
            sqlite3.Error: the commit failed; the record is as it was (still resumable),
              so the caller must not run the rollback.
        """
        flight = self._owner(ticket)
        if not isinstance(response, bytes):
            raise TypeError("response must be bytes")
        if status is not Status.FAILED or not flight.recorded_here:
            raise AssertionError("ledger: only pending work ends rolled back, and failed")
        new_state = advance(flight.state, LedgerEvent.ROLL_BACK)
        expires = int(self._clock()) + STALE_FACTOR * self._retention
        key, digest = ticket.key, ticket.digest
        await self._run(lambda conn: self._upsert(conn, key, digest, new_state, expires,
                                                  response=response, status=status,
                                                  code=code, tombstone=True))
        flight.state = new_state

    async def reserve(self, ticket: Ticket) -> None:
        """Durably record the key BEFORE an effect outside the ledger (a minted key).

        The record is indeterminate without pending work, and a tombstone, from the
        commit on: a retry finds it (`Fresh.recorded`), and so does one after any
        retention. Raises AssertionError if the ticket does not own its key.
        """
        flight = self._owner(ticket)
        new_state = advance(flight.state, LedgerEvent.RESERVE)
        expires = int(self._clock()) + STALE_FACTOR * self._retention
        key, digest = ticket.key, ticket.digest
        await self._run(lambda conn: self._upsert(conn, key, digest, new_state, expires,
                                                  tombstone=True))
        flight.state = new_state

    async def finish(self, ticket: Ticket, response: bytes, status: Status,
                     code: ErrorCode | None = None, *, keep_seconds: int | None = None,
                     refusal_of: str | None = None, tombstone: bool = False) -> None:
        """Record the verdict and end ownership; waiters wake.

        Args:
            response: the bytes to replay (final) or keep for the record (indeterminate);
                opaque here (the pipeline may hand in a compact form).
            status, code: the verdict's, stored as columns. succeeded/failed are final;
                indeterminate keeps the pending work so the next identical retry gets Resume
                (a rolled-back record: nothing is written, the retry gets RolledBack).
            keep_seconds: keep a final record this long instead of the retention (reads:
                their pages are large and replaying them is only a convenience).
            refusal_of: the credential whose refusal share pays for this record (a refusal
                reached before execution), instead of its agent's account.
            tombstone: keep (K, D) after the record expires (an action with effects that
                ran). An indeterminate verdict always keeps one.

        Raises:
            AssertionError: the ticket does not own its key, or the transition is illegal.
            sqlite3.Error: the commit failed; ownership is released (waiters look again).
        """
        flight = self._owner(ticket)
        if not isinstance(response, bytes):
            raise TypeError("response must be bytes")
        if not isinstance(status, Status):
            raise TypeError("status must be a Status")
        final = status is not Status.INDETERMINATE
        event = LedgerEvent.FINISH_FINAL if final else LedgerEvent.FINISH_INDETERMINATE
        new_state = advance(flight.state, event)
        if new_state is State.ROLLED_BACK:
            # Its rollback could not be finished: the stored failed verdict stays for the
            # retry, which runs the rollback again (`RolledBack`).
            self._drop(flight)
            return
        keep = self._retention if keep_seconds is None else min(keep_seconds, self._retention)
        expires = int(self._clock()) + (keep if final else STALE_FACTOR * self._retention)
        key, digest = ticket.key, ticket.digest
        charge = None if refusal_of is None else f"{account_of(key.principal)}/{refusal_of}"
        keep_tomb = tombstone or not final
        try:
            await self._run(lambda conn: self._upsert(conn, key, digest, new_state, expires,
                                                      response=response, status=status,
                                                      code=code, charge=charge,
                                                      tombstone=keep_tomb))
        except BaseException:
            self._drop(flight)
            raise
        flight.state = new_state
        if final:
            flight.final = Replay(response, status, code)
        self._drop(flight)

    def hand_over(self, ticket: Ticket, response: bytes, status: Status,
                  code: ErrorCode | None = None) -> None:
        """End ownership without a record, handing the verdict to whoever waits on this key.

        For a verdict the ledger does not keep (a read that ran, issue 24): an identical
        request that arrived while it ran is answered with it (`Replay`, as a final record
        would be); one that arrives later finds no record and runs again. Nothing is
        written. Raises AssertionError if the ticket does not own its key.
        """
        flight = self._owner(ticket)
        if status is not Status.INDETERMINATE:
            flight.final = Replay(response, status, code)
        self._drop(flight)

    def joins(self, key: LedgerKey) -> bool:
        """Whether `begin(key, ...)` now finds an owner of `key` in this process: it then
        waits for it (or answers `Conflict`), and whoever called it must authenticate the
        request again once it returns (NIP-BA: every attempt, and the release of a stored
        result). Synchronous: nothing runs between this answer and the `begin` after it."""
        return key in self._inflight

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
        busy = list(self._inflight)

        def op(conn: sqlite3.Connection) -> int:
            expired = conn.execute(
                f"SELECT pid, rid, {_SIZE_SQL}, charge FROM entries WHERE expires < ?", (now,)
            ).fetchall()
            # An owner in this process may be about to finish a stale key: keep it.
            busy_set = {(self._pids.get(k.principal), request_key(k.request_id)) for k in busy}
            doomed = [row for row in expired if (row[0], bytes(row[1])) not in busy_set]
            conn.executemany("DELETE FROM entries WHERE pid = ? AND rid = ?",
                             [(pid, rid) for pid, rid, _size, _charge in doomed])
            for pid, _rid, size, charge in doomed:
                self._charge(self._account(pid, charge), -int(size))
            return len(doomed)

        removed: int = await self._run(op)
        return removed

    async def count(self) -> int:
        """How many records the database holds (for tests, metrics and the benchmark)."""
        n = await self._run(
            lambda conn: int(conn.execute("SELECT count(*) FROM entries").fetchone()[0])
        )
        return n

    def usage(self, principal: str) -> int:
        """Bytes the principal's account counts against its cap (ROW_BYTES + blobs each,
        TOMBSTONE_BYTES per tombstone); refusals charged to a credential are not in it."""
        return self._usage.get(account_of(principal), 0)

    def refusal_usage(self, agent: str, credential: str) -> int:
        """Bytes of refusal records charged to one credential of `agent`."""
        return self._usage.get(f"{agent}/{credential}", 0)

    async def tombstones(self) -> int:
        """How many tombstones the database holds (tests, the sizing in the docs)."""
        n = await self._run(
            lambda conn: int(conn.execute("SELECT count(*) FROM tombstones").fetchone()[0]))
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


def _migrate_v1(conn: sqlite3.Connection, retention: int) -> bool:
    """Move records from the first layout (`ledger`: text keys, `updated_at`) into `entries`.

    One transaction; afterwards the old table is gone. Expiry is what the old sweep would
    have applied: retention after the last write for final records, STALE_FACTOR x for
    the rest.
    """
    if conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'ledger'"
                    ).fetchone() is None:
        return False
    conn.create_function("request_key", 1, lambda text: request_key(str(text)),
                         deterministic=True)
    with transaction(conn):
        conn.execute("INSERT OR IGNORE INTO principals (principal)"
                     " SELECT DISTINCT principal FROM ledger")
        conn.execute(
            "INSERT OR REPLACE INTO entries (pid, rid, digest, state, pending, response, expires)"
            " SELECT p.id, request_key(l.request_id), l.digest, l.state, l.pending, l.response,"
            " l.updated_at + CASE WHEN l.state = ? THEN ? ELSE ? END"
            " FROM ledger AS l JOIN principals AS p ON p.principal = l.principal",
            (State.FINAL.value, retention, STALE_FACTOR * retention))
        conn.execute("DROP TABLE ledger")
    return True


def _migrate_verdict_columns(conn: sqlite3.Connection, *, backfill: bool) -> None:
    """Add the `status` and `code` columns to a ledger made before them (issue 16).

    One transaction. Each recorded verdict's status and code are read once from its
    stored bytes (daemon/state/verdict_store.verdict_of); from then on they are columns.
    `backfill`: fill them although the columns exist (records `_migrate_v1` just moved in).
    """
    columns = {row[1] for row in conn.execute("PRAGMA table_info(entries)").fetchall()}
    if "status" in columns and not backfill:
        return
    with transaction(conn):
        if "status" not in columns:
            conn.execute("ALTER TABLE entries ADD COLUMN status TEXT")
            conn.execute("ALTER TABLE entries ADD COLUMN code TEXT")
        rows = conn.execute("SELECT pid, rid, response FROM entries"
                            " WHERE response IS NOT NULL AND status IS NULL").fetchall()
        for pid, rid, response in rows:
            status, code = verdict_of(bytes(response))
            conn.execute("UPDATE entries SET status = ?, code = ? WHERE pid = ? AND rid = ?",
                         (status.value, None if code is None else code.value, pid, rid))


def _migrate_charge_column(conn: sqlite3.Connection) -> None:
    """Add `charge` to a ledger made before refusals were charged to their credential
    (issue 22 M1). Existing records stay their agent's: NULL is the agent's account."""
    columns = {row[1] for row in conn.execute("PRAGMA table_info(entries)").fetchall()}
    if "charge" not in columns:
        conn.execute("ALTER TABLE entries ADD COLUMN charge INTEGER")


#: How SQLite keeps the statement that made a WITHOUT ROWID table (`sqlite_master.sql`).
_WITHOUT_ROWID = re.compile(r"\)\s*WITHOUT\s+ROWID\s*$", re.IGNORECASE)


def _migrate_rowid(conn: sqlite3.Connection, free_bytes: Callable[[], int]
                   ) -> KeptLayout | None:
    """Make a WITHOUT ROWID `entries` (every build before the rowid layout) a rowid table,
    when that is cheap and has room; else keep it and say why (None: moved, or nothing to).

    Cheap: its estimate (OLD_ROW_BYTES a record plus its blobs) is at most
    MOVE_AT_OPEN_MAX_BYTES. The count comes first (it reads the expiry index only); the
    blobs' lengths are summed only under the bound (`length()` reads a row's header, not
    its overflow pages). Room: `free_bytes()` is at least MOVE_FREE_DISK_FACTOR x it. Every
    query of this module reads and writes both layouts alike, so keeping one loses only
    disk; `entries` holds the records within retention, so a later open may find it small.

    The move is one transaction: the records copied byte for byte into the new table, the
    old one and its expiry index dropped, the new one renamed and indexed; a crash leaves
    the old layout whole, and the next open runs it again. The file does not shrink: the old
    table's pages become free pages that new records reuse (VACUUM would rewrite the whole
    file at every upgrade's first start, with as much free disk beside it). Read from the
    schema's text, not `PRAGMA table_list`, which SQLite before 3.37 does not have.
    """
    row = conn.execute("SELECT sql FROM sqlite_master WHERE type = 'table'"
                       " AND name = 'entries'").fetchone()
    if row is None or not _WITHOUT_ROWID.search(str(row[0])):
        return None
    records = int(conn.execute("SELECT count(*) FROM entries").fetchone()[0])
    if records * OLD_ROW_BYTES > MOVE_AT_OPEN_MAX_BYTES:
        return KeptLayout(KeptReason.TOO_MANY_RECORDS, records, None, None)
    blobs = conn.execute("SELECT total(length(pending)) + total(length(response))"
                         " FROM entries").fetchone()[0]
    estimate = records * OLD_ROW_BYTES + int(blobs)
    if estimate > MOVE_AT_OPEN_MAX_BYTES:
        return KeptLayout(KeptReason.TOO_MANY_RECORDS, records, estimate, None)
    free = free_bytes()
    if free < MOVE_FREE_DISK_FACTOR * estimate:
        return KeptLayout(KeptReason.NOT_ENOUGH_FREE_DISK, records, estimate, free)
    try:
        with transaction(conn):
            conn.execute(_ENTRIES_DDL.format(name="entries_rowid"))
            conn.execute(f"INSERT INTO entries_rowid ({_ENTRIES_COLUMNS})"
                         f" SELECT {_ENTRIES_COLUMNS} FROM entries")
            conn.execute("DROP TABLE entries")
            conn.execute("ALTER TABLE entries_rowid RENAME TO entries")
            conn.execute(_EXPIRY_INDEX_DDL)
    except sqlite3.OperationalError as exc:
        # The estimate is not the peak (large records cost the WAL more): a disk that
        # fills anyway keeps the old table, rolled back whole, rather than fail the start.
        if exc.sqlite_errorcode != sqlite3.SQLITE_FULL:
            raise
        return KeptLayout(KeptReason.NOT_ENOUGH_FREE_DISK, records, estimate, free)
    # The WAL grew to about the move's size: give that disk back now, not at a later
    # checkpoint that may never truncate it.
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return None


def read_anchor(path: Path | str) -> tuple[int, str] | None:
    """The audit anchor in a ledger file, read-only (the CLI; the daemon may be running).

    None when the file or the anchor does not exist. Raises sqlite3.Error on a bad file.
    """
    if not Path(path).is_file():
        return None
    conn = sqlite3.connect(f"file:{Path(path)}?mode=ro", uri=True)
    try:
        conn.execute(f"PRAGMA busy_timeout={READ_BUSY_TIMEOUT_MS * 10}")
        has_table = conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'audit_anchor'"
                                 ).fetchone()
        return None if has_table is None else Ledger._read_anchor(conn)
    finally:
        conn.close()


def write_anchor(path: Path | str, head: tuple[int, str]) -> None:
    """Set the audit anchor (`audit reanchor`; the daemon must not be running)."""
    conn = open_private_db(Path(path), _SCHEMA)
    try:
        with transaction(conn):
            conn.execute(
                "INSERT INTO audit_anchor (id, seq, head) VALUES (1, ?, ?)"
                " ON CONFLICT (id) DO UPDATE SET seq = excluded.seq, head = excluded.head",
                head)
    finally:
        conn.close()


def read_record(path: Path | str, principal: str, request_id: str
                ) -> tuple[State, bytes | None, bytes | None] | None:
    """(state, pending, response) of one record, read from the file (tests and tools)."""
    conn = sqlite3.connect(str(path))
    try:
        row = conn.execute(
            "SELECT e.state, e.pending, e.response FROM entries AS e"
            " JOIN principals AS p ON p.id = e.pid WHERE p.principal = ? AND e.rid = ?",
            (principal, request_key(request_id))).fetchone()
    finally:
        conn.close()
    return None if row is None else (State(row[0]), row[1], row[2])


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


def _select(conn: sqlite3.Connection, pid: int, key: LedgerKey) -> _Row | None:
    row = conn.execute(
        "SELECT digest, state, pending, response, status, code FROM entries"
        " WHERE pid = ? AND rid = ?",
        (pid, request_key(key.request_id)),
    ).fetchone()
    if row is None:
        return None
    return _Row(digest=bytes(row[0]), state=State(row[1]), pending=row[2], response=row[3],
                status=row[4], code=row[5])
