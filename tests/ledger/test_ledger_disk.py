"""The ledger's disk bounds and the audit anchor (issue 13): compact refusals, short-lived
reads, the per-principal cap, the first layout's migration, the anchor's commit."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from buzzwire.contract import (
    MESSAGES,
    ErrorCode,
    PublishOutcome,
    Status,
    Verdict,
    encode_response,
)
from daemon.state.audit import AuditLog, RefusalCount, read_records
from daemon.state.ledger import (
    _SCHEMA,
    ROW_BYTES,
    TOMBSTONE_BYTES,
    Conflict,
    MOVE_AT_OPEN_MAX_BYTES,
    MOVE_FREE_DISK_FACTOR,
    OLD_ROW_BYTES,
    Forgotten,
    Fresh,
    Full,
    KeptReason,
    Ledger,
    LedgerKey,
    Replay,
    Resume,
    read_anchor,
    read_record,
    request_key,
    write_anchor,
)
from daemon.state.refusal_audit import RefusalAudit
from daemon.state.verdict_store import expanded_form, stored_form

AGENT = "a" * 64
T0 = 1_800_000_000


def digest(body: bytes) -> bytes:
    return hashlib.sha256(body).digest()


class Clock:
    def __init__(self) -> None:
        self.t = float(T0)

    def __call__(self) -> float:
        return self.t


async def _record(ledger: Ledger, request_id: str, response: bytes, *,
                  keep: int | None = None, principal: str = AGENT) -> None:
    begun = await ledger.begin(LedgerKey(principal, request_id), digest(request_id.encode()))
    assert isinstance(begun, Fresh)
    await ledger.finish(begun.ticket, response, Status.SUCCEEDED, keep_seconds=keep)


def test_a_refusal_is_stored_as_its_code_and_replays_byte_for_byte() -> None:
    for verdict in (Verdict.failed(ErrorCode.UNAUTHORIZED),
                    Verdict.failed(ErrorCode.UNAUTHORIZED, "this channel is not permitted"),
                    Verdict.failed(ErrorCode.INVALID_REQUEST, "ünïcode ✓ message")):
        response = encode_response("req-1", verdict)
        stored = stored_form("req-1", response, verdict.status, verdict.code)
        assert len(stored) < 64 < len(response)
        assert expanded_form("req-1", stored) == response
    # Anything else is kept verbatim, and verbatim bytes expand to themselves.
    unknown = encode_response("req-1", Verdict.indeterminate(ErrorCode.OUTCOME_UNKNOWN))
    assert stored_form("req-1", unknown, Status.INDETERMINATE, ErrorCode.OUTCOME_UNKNOWN
                       ) == unknown
    assert expanded_form("req-1", unknown) == unknown
    # A compact form from a newer version (an unknown code) is refused, never guessed at.
    with pytest.raises(ValueError):
        expanded_form("req-1", b"\x00payment_required")
    # A response that does not re-encode the same way is never compacted.
    odd = encode_response("req-1", Verdict.failed(ErrorCode.UNAUTHORIZED)).replace(b",", b", ")
    assert stored_form("req-1", odd, Status.FAILED, ErrorCode.UNAUTHORIZED) == odd
    assert MESSAGES[ErrorCode.UNAUTHORIZED].encode() not in stored_form(
        "req-1", encode_response("req-1", Verdict.failed(ErrorCode.UNAUTHORIZED)),
        Status.FAILED, ErrorCode.UNAUTHORIZED)


async def test_reads_expire_first_and_an_expired_read_runs_again(tmp_path: Path) -> None:
    clock = Clock()
    ledger = Ledger.open(tmp_path / "ledger.db", retention_seconds=3600, clock=clock)
    try:
        await _record(ledger, "read", b'{"page":1}', keep=60)
        await _record(ledger, "refusal", b"\x00unauthorized")
        clock.t += 61
        assert await ledger.sweep(int(clock.t)) == 1
        again = await ledger.begin(LedgerKey(AGENT, "read"), digest(b"read"))
        assert isinstance(again, Fresh)  # runs afresh: a read has no effect to repeat
        ledger.release(again.ticket)
        kept = await ledger.begin(LedgerKey(AGENT, "refusal"), digest(b"refusal"))
        assert isinstance(kept, Replay)
    finally:
        ledger.close()


async def test_a_keep_longer_than_retention_expires_at_retention(tmp_path: Path) -> None:
    clock = Clock()
    ledger = Ledger.open(tmp_path / "ledger.db", retention_seconds=3600, clock=clock)
    try:
        await _record(ledger, "long", b'{"page":1}', keep=7200)
        clock.t += 3600 + 1
        assert await ledger.sweep(int(clock.t)) == 1  # retention bounds every record
        again = await ledger.begin(LedgerKey(AGENT, "long"), digest(b"long"))
        assert isinstance(again, Fresh)
        ledger.release(again.ticket)
    finally:
        ledger.close()


async def test_the_cap_refuses_new_records_only(tmp_path: Path) -> None:
    clock = Clock()
    cap = 10 * ROW_BYTES
    ledger = Ledger.open(tmp_path / "ledger.db", retention_seconds=3600,
                         max_bytes_per_principal=cap, clock=clock)
    try:
        i = 0
        while ledger.usage(AGENT) < cap:
            await _record(ledger, f"r{i}", b"\x00unauthorized")
            i += 1
        assert i == 10 - 1 or i == 10
        full = await ledger.begin(LedgerKey(AGENT, "one-more"), digest(b"one-more"))
        assert isinstance(full, Full)
        # Nothing claimed: the same key asks again and gets the same answer, not a wait.
        with trio.fail_after(1):
            assert isinstance(await ledger.begin(LedgerKey(AGENT, "one-more"),
                                                 digest(b"one-more")), Full)
        # Replays add nothing and still answer; another principal has its own share.
        assert isinstance(await ledger.begin(LedgerKey(AGENT, "r0"), digest(b"r0")), Replay)
        await _record(ledger, "theirs", b"x", principal="b" * 64)
        # Records expire, the share frees.
        clock.t += 3601
        await ledger.sweep(int(clock.t))
        assert ledger.usage(AGENT) == 0
        again = await ledger.begin(LedgerKey(AGENT, "one-more"), digest(b"one-more"))
        assert isinstance(again, Fresh)
        await ledger.finish(again.ticket, b"x", Status.SUCCEEDED)
        assert ledger.usage(AGENT) == ROW_BYTES + 1
    finally:
        ledger.close()
    # The usage is rebuilt from the file at open.
    reopened = Ledger.open(tmp_path / "ledger.db", retention_seconds=3600)
    try:
        assert reopened.usage(AGENT) == ROW_BYTES + 1
    finally:
        reopened.close()


async def test_usage_exactly_at_the_cap_is_full(tmp_path: Path) -> None:
    # Each record of a one-byte response costs ROW_BYTES + 1: three of them fill the cap to
    # the byte, and a share that is used up is full, not one byte short of it.
    cap = 3 * (ROW_BYTES + 1)
    ledger = Ledger.open(tmp_path / "ledger.db", retention_seconds=3600,
                         max_bytes_per_principal=cap, clock=Clock())
    try:
        for i in range(2):
            await _record(ledger, f"r{i}", b"x")
        assert ledger.usage(AGENT) == cap - (ROW_BYTES + 1)
        await _record(ledger, "r2", b"x")  # one record short of the cap: still taken
        assert ledger.usage(AGENT) == cap
        full = await ledger.begin(LedgerKey(AGENT, "one-more"), digest(b"one-more"))
        assert isinstance(full, Full)
    finally:
        ledger.close()


OLD_SUCCESS = encode_response("old-final", Verdict.succeeded(
    "message.post", PublishOutcome(event_id="e" * 64, kind=9, created_at=T0)))


async def test_records_before_verdict_columns_get_them(tmp_path: Path) -> None:
    # A ledger of the layout before status and code were columns (issue 13's): its
    # records replay with the status and code their bytes held, never re-parsed later.
    path = tmp_path / "ledger.db"
    refusal = stored_form("r-refused", encode_response(
        "r-refused", Verdict.failed(ErrorCode.UNAUTHORIZED)), Status.FAILED,
        ErrorCode.UNAUTHORIZED)
    assert refusal.startswith(b"\x00")
    unknown = encode_response("r-unknown", Verdict.indeterminate(ErrorCode.OUTCOME_UNKNOWN))
    old = sqlite3.connect(path)
    old.executescript("""
        CREATE TABLE principals (id INTEGER PRIMARY KEY, principal TEXT NOT NULL UNIQUE);
        CREATE TABLE entries (pid INTEGER NOT NULL, rid BLOB NOT NULL, digest BLOB NOT NULL,
            state TEXT NOT NULL, pending BLOB, response BLOB, expires INTEGER NOT NULL,
            PRIMARY KEY (pid, rid)) WITHOUT ROWID;
        CREATE INDEX entries_by_expiry ON entries (expires);
        CREATE TABLE audit_anchor (id INTEGER PRIMARY KEY CHECK (id = 1),
            seq INTEGER NOT NULL, head TEXT NOT NULL);
    """)
    old.execute("INSERT INTO principals VALUES (1, ?)", (AGENT,))
    far = T0 + 10**6
    for rid, state, pending, response in [("old-final", "final", None, OLD_SUCCESS),
                                          ("r-refused", "final", None, refusal),
                                          ("r-unknown", "indeterminate", b"signed", unknown)]:
        old.execute("INSERT INTO entries VALUES (1, ?, ?, ?, ?, ?, ?)",
                    (request_key(rid), digest(rid.encode()), state, pending, response, far))
    old.commit()
    old.close()
    ledger = Ledger.open(path, retention_seconds=3600, clock=Clock())
    try:
        assert await ledger.begin(LedgerKey(AGENT, "old-final"), digest(b"old-final")) == (
            Replay(OLD_SUCCESS, Status.SUCCEEDED))
        assert await ledger.begin(LedgerKey(AGENT, "r-refused"), digest(b"r-refused")) == (
            Replay(refusal, Status.FAILED, ErrorCode.UNAUTHORIZED))
    finally:
        ledger.close()
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT status, code FROM entries WHERE rid = ?",
                        (request_key("r-unknown"),)).fetchone() == (
        "indeterminate", "outcome_unknown")
    conn.close()


async def test_a_credentials_own_records_count_against_its_agents_cap(tmp_path: Path) -> None:
    # Scope refusals are kept under `<agent>/<credential>` (daemon/pipeline/broker.py), so that a
    # narrow credential cannot pre-empt a requestId; they still fill the agent's one cap.
    cap = 4 * ROW_BYTES
    path = tmp_path / "ledger.db"
    ledger = Ledger.open(path, retention_seconds=3600, max_bytes_per_principal=cap)
    apart = f"{AGENT}/cred-1"
    try:
        i = 0
        while ledger.usage(AGENT) < cap:
            await _record(ledger, f"r{i}", b"\x00unauthorized", principal=apart)
            i += 1
        assert ledger.usage(apart) == ledger.usage(AGENT) >= cap
        for principal in (AGENT, apart, f"{AGENT}/cred-2"):
            full = await ledger.begin(LedgerKey(principal, "one-more"), digest(b"one-more"))
            assert isinstance(full, Full), principal
        fresh = await ledger.begin(LedgerKey("b" * 64, "one-more"), digest(b"one-more"))
        assert isinstance(fresh, Fresh)
        ledger.release(fresh.ticket)
    finally:
        ledger.close()
    reopened = Ledger.open(path, retention_seconds=3600, max_bytes_per_principal=cap)
    try:
        assert reopened.usage(AGENT) >= cap
        full = await reopened.begin(LedgerKey(AGENT, "one-more"), digest(b"one-more"))
        assert isinstance(full, Full)
    finally:
        reopened.close()


async def test_records_of_the_first_layout_are_migrated(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    old = sqlite3.connect(path)
    old.executescript("""
        CREATE TABLE ledger (principal TEXT NOT NULL, request_id TEXT NOT NULL,
            digest BLOB NOT NULL, state TEXT NOT NULL, pending BLOB, response BLOB,
            created_at INTEGER NOT NULL, updated_at INTEGER NOT NULL,
            PRIMARY KEY (principal, request_id)) WITHOUT ROWID;
        CREATE INDEX ledger_by_age ON ledger (state, updated_at);
    """)
    old.execute("INSERT INTO ledger VALUES (?, 'old-final', ?, 'final', NULL, ?, ?, ?)",
                (AGENT, digest(b"old-final"), OLD_SUCCESS, T0, T0))
    old.execute("INSERT INTO ledger VALUES (?, 'old-pending', ?, 'pending', ?, NULL, ?, ?)",
                (AGENT, digest(b"old-pending"), b"signed", T0, T0))
    old.commit()
    old.close()
    clock = Clock()
    ledger = Ledger.open(path, retention_seconds=3600, clock=clock)
    try:
        replay = await ledger.begin(LedgerKey(AGENT, "old-final"), digest(b"old-final"))
        assert replay == Replay(OLD_SUCCESS, Status.SUCCEEDED)
        assert read_record(path, AGENT, "old-pending")[1] == b"signed"  # type: ignore[index]
        clock.t += 3601  # the final one expires on the old schedule; pending lives longer
        assert await ledger.sweep(int(clock.t)) == 1
    finally:
        ledger.close()
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT name FROM sqlite_master WHERE name = 'ledger'").fetchone() is None
    conn.close()


async def test_the_audit_head_is_anchored_with_the_verdict(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    ledger = Ledger.open(path, retention_seconds=3600)
    audit = AuditLog.open(tmp_path / "audit")
    try:
        assert read_anchor(path) is None and ledger.audit_anchor is None
        ledger.anchor_audit(lambda: audit.head)
        refusals = RefusalAudit(audit, Clock())
        await refusals.flush(everything=True)  # nothing counted: nothing written
        assert audit.head[0] == 0
        await audit.append(RefusalCount(at=T0, since=T0, credential_id="cred_" + "0" * 16,
                                        agent=AGENT, action=None, code=ErrorCode.UNAUTHORIZED,
                                        count=1))
        # The next ledger commit carries the head that was durable before it.
        await _record(ledger, "r", b"x")
        assert read_anchor(path) == audit.head == ledger.audit_anchor
        await audit.append(RefusalCount(at=T0, since=T0, credential_id="cred_" + "0" * 16,
                                        agent=AGENT, action=None, code=ErrorCode.UNAUTHORIZED,
                                        count=2))
        await ledger.anchor()  # no verdict to ride on: a commit of its own
        assert read_anchor(path) == audit.head and audit.head[0] == 2
    finally:
        await audit.aclose()
        ledger.close()
    write_anchor(path, (1, "ef" * 32))  # the re-anchor command's write
    assert read_anchor(path) == (1, "ef" * 32)


async def test_refusals_past_the_burst_are_counted(tmp_path: Path) -> None:
    clock = Clock()
    audit = AuditLog.open(tmp_path / "audit")
    refusals = RefusalAudit(audit, clock, burst=3, refill_per_second=0.5, window_seconds=60)
    cred = "cred_" + "1" * 16
    admitted = [refusals.admit(cred) for _ in range(10)]
    assert admitted == [True] * 3 + [False] * 7
    assert refusals.admit("cred_" + "2" * 16)  # another credential has its own burst
    for _ in range(7):
        refusals.count(cred, AGENT, "message.post", ErrorCode.UNAUTHORIZED)
    refusals.count(cred, AGENT, None, ErrorCode.INVALID_REQUEST)
    clock.t += 2
    assert refusals.admit(cred)  # refilled one
    await refusals.flush()
    assert audit.head[0] == 0 and refusals.counted == 8  # the window is still open
    clock.t += 60
    await refusals.flush()
    assert refusals.counted == 0
    await audit.aclose()
    counts = sorted((r.record.code.value, r.record.count) for r in read_records(tmp_path / "audit")
                    if isinstance(r.record, RefusalCount))
    assert counts == [("invalid_request", 1), ("unauthorized", 7)]
    assert json.loads((tmp_path / "audit" / "audit-000001.jsonl").read_text().splitlines()[0]
                      )["since"] == "2027-01-15T08:00:00.000Z"


async def test_a_batch_sqlite_rolled_back_whole_commits_none_of_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SQLITE_FULL (or IOERR, NOMEM) inside a statement may roll back the whole
    transaction, not just the op's savepoint. The ops after it must not run: a SAVEPOINT
    outside a transaction opens one of its own and its RELEASE commits it, so a record
    would be durable while its caller was told it failed, and the cap's count would miss it.

    Scripted fault: a real cache spill on a full disk is hard to trigger on demand, so one
    op ends its transaction with ROLLBACK and raises the error SQLite gives for it, as a
    spill would. Another op holds the writer, so the three after it share one batch."""
    path = tmp_path / "ledger.db"
    ledger = Ledger.open(path, retention_seconds=3600, clock=Clock())
    gate = threading.Event()
    real_upsert = Ledger._upsert

    def upsert(self: Ledger, conn: sqlite3.Connection, key: LedgerKey, *args: Any,
               **kwargs: Any) -> None:
        if key.request_id == "req-hold":
            assert gate.wait(10)
        if key.request_id == "req-full":
            conn.execute("ROLLBACK")
            raise sqlite3.OperationalError("database or disk is full")
        real_upsert(self, conn, key, *args, **kwargs)

    monkeypatch.setattr(Ledger, "_upsert", upsert)
    other = "b" * 64  # a principal new to the ledger: its id is made in the lost transaction
    keys = [LedgerKey(AGENT, "req-hold"), LedgerKey(AGENT, "req-before"),
            LedgerKey(AGENT, "req-full"), LedgerKey(other, "req-after")]
    tickets = []
    for key in keys:
        begun = await ledger.begin(key, digest(key.request_id.encode()))
        assert isinstance(begun, Fresh)
        tickets.append(begun.ticket)
    outcome: dict[str, str] = {}

    async def finish(index: int) -> None:
        try:
            await ledger.finish(tickets[index], b"verdict", Status.SUCCEEDED)
            outcome[keys[index].request_id] = "durable"
        except sqlite3.Error:
            outcome[keys[index].request_id] = "failed"

    async with trio.open_nursery() as nursery:
        for index in range(len(keys)):
            nursery.start_soon(finish, index)
            # In order, each queued before the next: the first holds the writer.
            await trio.testing.wait_all_tasks_blocked()
        gate.set()
    assert outcome == {"req-hold": "durable", "req-before": "failed", "req-full": "failed",
                       "req-after": "failed"}
    # What the callers heard is what is on disk.
    assert read_record(path, AGENT, "req-hold") is not None
    for key in keys[1:]:
        assert read_record(path, key.principal, key.request_id) is None, key
    # The in-memory count is the one a fresh open makes from the file.
    counted = (ledger.usage(AGENT), ledger.usage(other))
    ledger.close()
    reopened = Ledger.open(path, retention_seconds=3600, clock=Clock())
    try:
        assert counted == (reopened.usage(AGENT), reopened.usage(other)) == (
            ROW_BYTES + len(b"verdict"), 0)
        # The failed ones are new again: their retry runs.
        retry = await reopened.begin(keys[3], digest(b"req-after"))
        assert isinstance(retry, Fresh) and not retry.recorded
        await reopened.finish(retry.ticket, b"verdict", Status.SUCCEEDED)
        assert reopened.usage(other) == ROW_BYTES + len(b"verdict")
    finally:
        reopened.close()


def file_bytes(path: Path) -> int:
    """Bytes of the file in use after a checkpoint (free pages, which SQLite reuses, not)."""
    conn = sqlite3.connect(str(path))
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        free = conn.execute("PRAGMA freelist_count").fetchone()[0]
        page = conn.execute("PRAGMA page_size").fetchone()[0]
        return int((pages - free) * page)
    finally:
        conn.close()


def _blob(seed: str, size: int) -> bytes:
    # Incompressible-looking text of the size a signed event batch has (SQLite does not
    # compress, but nothing here should look like a run of one byte either).
    return (hashlib.sha256(seed.encode()).hexdigest() * (size // 64 + 1))[:size].encode()


#: Published records as the pipeline writes them: the pending work (signed events in the
#: `Pending` encoding: ~800 bytes of event, signature and stored answer around the content)
#: and a `Published` verdict. name -> pending bytes.
_PUBLISHED_SHAPES: dict[str, int] = {
    "short post (~100 characters) or live signal": 900,
    "post of ~1.3 KB": 2_100,
    "observer.emit batch": 3_600,
}


async def test_a_published_record_costs_on_disk_about_what_the_cap_counts(
        tmp_path: Path) -> None:
    """Disk per record, measured on the file after a checkpoint, against what `usage` counts
    for it (ROW_BYTES + its blobs + its tombstone): the figures of docs/operations.md's
    sizing table. A row SQLite cannot keep in its b-tree page costs a 4 KiB overflow page
    besides (the WITHOUT ROWID layout, whose limit is ~1 KB: 3.5x for a short post).
    A rowid leaf page holds whole rows, so a row just over half a page has one to itself:
    2x is the bound, reached only there (1.6x for the 1.3 KB post)."""
    n = 300
    measured: dict[str, tuple[float, float]] = {}
    for shape, pending_size in _PUBLISHED_SHAPES.items():
        path = tmp_path / f"{len(measured)}.db"
        ledger = Ledger.open(path, retention_seconds=3600, clock=Clock())
        try:
            await _record(ledger, "warm-up", b"{}")  # the tables and the principal exist
            before, counted_before = file_bytes(path), ledger.usage(AGENT)
            for i in range(n):
                request_id = f"r-{i}"
                begun = await ledger.begin(LedgerKey(AGENT, request_id),
                                           digest(request_id.encode()))
                assert isinstance(begun, Fresh)
                await ledger.record_pending(begun.ticket, _blob(request_id, pending_size))
                answer = encode_response(request_id, Verdict.succeeded(
                    "message.post", PublishOutcome(event_id=digest(request_id.encode()).hex(),
                                                   kind=9, created_at=T0)))
                await ledger.finish(begun.ticket, answer, Status.SUCCEEDED, tombstone=True)
            counted = (ledger.usage(AGENT) - counted_before) / n
        finally:
            ledger.close()
        measured[shape] = ((file_bytes(path) - before) / n, counted)
    for shape, (disk, counted) in measured.items():
        print(f"\n{shape}: {disk:.0f} bytes of file a record, {counted:.0f} counted"
              f" ({disk / counted:.2f}x)")
    assert all(disk < 2 * counted for disk, counted in measured.values()), measured


#: `entries` as every build before the rowid layout made it (issue 13 to issue 22 M1).
_WITHOUT_ROWID_ENTRIES = """
    CREATE TABLE principals (id INTEGER PRIMARY KEY, principal TEXT NOT NULL UNIQUE);
    CREATE TABLE entries (pid INTEGER NOT NULL, rid BLOB NOT NULL, digest BLOB NOT NULL,
        state TEXT NOT NULL, pending BLOB, response BLOB, status TEXT, code TEXT,
        expires INTEGER NOT NULL, charge INTEGER, PRIMARY KEY (pid, rid)) WITHOUT ROWID;
    CREATE INDEX entries_by_expiry ON entries (expires);
    CREATE TABLE tombstones (pid INTEGER NOT NULL, rid BLOB NOT NULL, digest BLOB NOT NULL,
        PRIMARY KEY (pid, rid)) WITHOUT ROWID;
    CREATE TABLE audit_anchor (id INTEGER PRIMARY KEY CHECK (id = 1),
        seq INTEGER NOT NULL, head TEXT NOT NULL);
"""


def _rows(path: Path) -> list[tuple[object, ...]]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute(
            "SELECT pid, rid, digest, state, pending, response, status, code, expires, charge"
            " FROM entries ORDER BY pid, rid").fetchall()
    finally:
        conn.close()


def _without_rowid(path: Path) -> bool:
    conn = sqlite3.connect(path)
    try:
        return bool(conn.execute("SELECT wr FROM pragma_table_list WHERE name = 'entries'"
                                 ).fetchone()[0])
    finally:
        conn.close()


async def test_a_without_rowid_ledger_becomes_a_rowid_one_keeping_every_record(
        tmp_path: Path) -> None:
    # The layout before (a row over ~1 KB spilled to a 4 KiB overflow page): pending,
    # final, a credential's refusal and a tombstone whose record was swept open with the
    # new code, keep every byte and verdict, and replay as they did.
    path = tmp_path / "ledger.db"
    refusal = b"\x00unauthorized"
    far = T0 + 10**6
    old = sqlite3.connect(path)
    old.executescript(_WITHOUT_ROWID_ENTRIES)
    old.executemany("INSERT INTO principals VALUES (?, ?)",
                    [(1, AGENT), (2, f"{AGENT}/narrow")])
    old.executemany("INSERT INTO entries VALUES (1, ?, ?, ?, ?, ?, ?, ?, ?, ?)", [
        (request_key(rid), digest(rid.encode()), state, pending, response, status, code,
         far, charge)
        for rid, state, pending, response, status, code, charge in [
            ("p-1", "pending", _blob("p-1", 2_000), None, None, None, None),
            ("f-1", "final", None, OLD_SUCCESS, "succeeded", None, None),
            ("f-2", "final", _blob("f-2", 900), OLD_SUCCESS, "succeeded", None, None),
            ("r-1", "final", None, refusal, "failed", "unauthorized", 2),
        ]])
    old.executemany("INSERT INTO tombstones VALUES (1, ?, ?)", [
        (request_key(rid), digest(rid.encode())[:16]) for rid in ("p-1", "f-2", "gone")])
    old.commit()
    old.close()
    before = _rows(path)
    assert _without_rowid(path)

    ledger = Ledger.open(path, retention_seconds=3600, clock=Clock())
    try:
        assert ledger.layout_kept is None
        usage = ledger.usage(AGENT), ledger.refusal_usage(AGENT, "narrow")
        resume = await ledger.begin(LedgerKey(AGENT, "p-1"), digest(b"p-1"))
        assert isinstance(resume, Resume) and resume.pending == _blob("p-1", 2_000)
        ledger.release(resume.ticket)
        assert await ledger.begin(LedgerKey(AGENT, "f-1"), digest(b"f-1")) == (
            Replay(OLD_SUCCESS, Status.SUCCEEDED))
        assert await ledger.begin(LedgerKey(AGENT, "r-1"), digest(b"r-1")) == (
            Replay(refusal, Status.FAILED, ErrorCode.UNAUTHORIZED))
        assert isinstance(await ledger.begin(LedgerKey(AGENT, "gone"), digest(b"gone")),
                          Forgotten)
        assert isinstance(await ledger.begin(LedgerKey(AGENT, "f-1"), digest(b"other")),
                          Conflict)
    finally:
        ledger.close()
    assert not _without_rowid(path)
    assert _rows(path) == before
    # Idempotent: a second open finds the new layout and changes nothing; the usage it
    # counts is the one the first open counted from the old table.
    again = Ledger.open(path, retention_seconds=3600, clock=Clock())
    try:
        assert (again.usage(AGENT), again.refusal_usage(AGENT, "narrow")) == usage
        assert usage[0] == (3 * ROW_BYTES + 2_000 + 900 + 2 * len(OLD_SUCCESS)
                            + 3 * TOMBSTONE_BYTES)
        resumed = await again.begin(LedgerKey(AGENT, "p-1"), digest(b"p-1"))
        assert isinstance(resumed, Resume)
        await again.finish(resumed.ticket, OLD_SUCCESS, Status.SUCCEEDED, tombstone=True)
        assert await again.begin(LedgerKey(AGENT, "p-1"), digest(b"p-1")) == (
            Replay(OLD_SUCCESS, Status.SUCCEEDED))
        assert await again.sweep(far + 1) == 4
        assert await again.count() == 0 and await again.tombstones() == 3
    finally:
        again.close()
    assert _rows(path) == []


def _old_layout(path: Path, records: int) -> None:
    """A WITHOUT ROWID ledger of `records` refusals and one pending record (`p-old`)."""
    old = sqlite3.connect(path)
    old.executescript(_WITHOUT_ROWID_ENTRIES)
    old.execute("INSERT INTO principals VALUES (1, ?)", (AGENT,))
    old.execute("INSERT INTO entries VALUES (1, ?, ?, 'pending', ?, NULL, NULL, NULL, ?, NULL)",
                (request_key("p-old"), digest(b"p-old"), _blob("p-old", 2_000), T0 + 7200))
    old.executemany(
        "INSERT INTO entries VALUES (1, ?, ?, 'final', NULL, ?, 'failed', 'unauthorized', ?,"
        " NULL)", ((request_key(f"r-{i}"), digest(f"r-{i}".encode()), b"\x00unauthorized",
                    T0 + 60) for i in range(records - 1)))
    old.execute("INSERT INTO tombstones VALUES (1, ?, ?)",
                (request_key("p-old"), digest(b"p-old")[:16]))
    old.commit()
    old.close()


async def _works_as_before(ledger: Ledger, records: int) -> None:
    """The ledger's operations on whichever layout `entries` has: a fresh record pending
    then final and replayed, an old pending record resumed and finished, a refusal
    replayed, a conflict, the sweep of what expired and a forgotten key after it."""
    begun = await ledger.begin(LedgerKey(AGENT, "new"), digest(b"new"))
    assert isinstance(begun, Fresh)
    await ledger.record_pending(begun.ticket, _blob("new", 2_500))
    await ledger.finish(begun.ticket, OLD_SUCCESS, Status.SUCCEEDED, tombstone=True)
    assert await ledger.begin(LedgerKey(AGENT, "new"), digest(b"new")) == (
        Replay(OLD_SUCCESS, Status.SUCCEEDED))
    resumed = await ledger.begin(LedgerKey(AGENT, "p-old"), digest(b"p-old"))
    assert isinstance(resumed, Resume) and resumed.pending == _blob("p-old", 2_000)
    await ledger.finish(resumed.ticket, OLD_SUCCESS, Status.SUCCEEDED, tombstone=True)
    assert await ledger.begin(LedgerKey(AGENT, "r-0"), digest(b"r-0")) == (
        Replay(b"\x00unauthorized", Status.FAILED, ErrorCode.UNAUTHORIZED))
    assert isinstance(await ledger.begin(LedgerKey(AGENT, "r-0"), digest(b"x")), Conflict)
    assert await ledger.count() == records + 1
    assert await ledger.sweep(T0 + 61) == records - 1  # the refusals, not the two others
    assert isinstance(await ledger.begin(LedgerKey(AGENT, "p-old"), digest(b"p-old")), Replay)
    forgotten = await ledger.begin(LedgerKey(AGENT, "r-0"), digest(b"r-0"))
    assert isinstance(forgotten, Fresh)  # a refusal leaves no tombstone: it runs again
    ledger.release(forgotten.ticket)
    assert await ledger.tombstones() == 2


async def test_an_old_ledger_over_the_bound_stays_old_and_works_as_before(
        tmp_path: Path) -> None:
    # More records than MOVE_AT_OPEN_MAX_BYTES lets the start move (at OLD_ROW_BYTES each):
    # the move could outlast systemd's start timeout, so the table stays and says why.
    path = tmp_path / "ledger.db"
    records = MOVE_AT_OPEN_MAX_BYTES // OLD_ROW_BYTES + 1
    _old_layout(path, records)
    asked: list[Path] = []

    def free(directory: Path) -> int:
        asked.append(directory)
        return 2**60

    ledger = Ledger.open(path, retention_seconds=3600, clock=Clock(), free_bytes=free)
    try:
        kept = ledger.layout_kept
        assert kept is not None and kept.reason is KeptReason.TOO_MANY_RECORDS
        assert kept.records == records and asked == []  # the count alone decided
        await _works_as_before(ledger, records)
    finally:
        ledger.close()
    assert _without_rowid(path)
    # Fewer records within retention now: the next start moves them.
    again = Ledger.open(path, retention_seconds=3600, clock=Clock(), free_bytes=free)
    try:
        assert again.layout_kept is None and asked == [tmp_path]
        assert await again.count() == 2
    finally:
        again.close()
    assert not _without_rowid(path)


async def test_an_old_ledger_without_free_disk_for_the_move_stays_old_and_works(
        tmp_path: Path) -> None:
    # Room for the move's estimate but not MOVE_FREE_DISK_FACTOR times it (the new table and
    # the WAL of the old one's freed pages): the old table stays rather than the start
    # failing "disk is full".
    path = tmp_path / "ledger.db"
    _old_layout(path, 10)
    estimate = 10 * OLD_ROW_BYTES + 2_000 + 9 * len(b"\x00unauthorized")
    ledger = Ledger.open(path, retention_seconds=3600, clock=Clock(),
                         free_bytes=lambda _directory: MOVE_FREE_DISK_FACTOR * estimate - 1)
    try:
        kept = ledger.layout_kept
        assert kept is not None and kept.reason is KeptReason.NOT_ENOUGH_FREE_DISK
        assert (kept.records, kept.move_bytes, kept.free_bytes) == (
            10, estimate, MOVE_FREE_DISK_FACTOR * estimate - 1)
        await _works_as_before(ledger, 10)
    finally:
        ledger.close()
    assert _without_rowid(path)
    moved = Ledger.open(path, retention_seconds=3600, clock=Clock(),
                        free_bytes=lambda _directory: MOVE_FREE_DISK_FACTOR * estimate)
    try:
        assert moved.layout_kept is None
    finally:
        moved.close()
    assert not _without_rowid(path)


async def test_a_move_the_disk_cannot_hold_keeps_the_old_layout_and_the_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The estimate is not the peak: a disk that fills during the move anyway (SQLITE_FULL,
    # here a page cap on the ledger's connection) rolls it back whole and keeps the old
    # table, instead of failing the open, which is the daemon's start, at every restart.
    from daemon.state import ledger as ledger_module

    path = tmp_path / "ledger.db"
    _old_layout(path, 10)
    real = ledger_module.open_private_db

    def tight(db_path: Path, schema: str) -> sqlite3.Connection:
        conn = real(db_path, schema)
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        conn.execute(f"PRAGMA max_page_count={pages}")
        return conn

    monkeypatch.setattr(ledger_module, "open_private_db", tight)
    ledger = Ledger.open(path, retention_seconds=3600, clock=Clock(),
                         free_bytes=lambda _directory: 2**60)
    try:
        kept = ledger.layout_kept
        assert kept is not None and kept.reason is KeptReason.NOT_ENOUGH_FREE_DISK
        assert kept.records == 10
    finally:
        ledger.close()
    assert _without_rowid(path)
    monkeypatch.setattr(ledger_module, "open_private_db", real)
    moved = Ledger.open(path, retention_seconds=3600, clock=Clock())
    try:
        assert moved.layout_kept is None
        # The WAL the move grew is given back at once, not at some later checkpoint.
        assert (tmp_path / "ledger.db-wal").stat().st_size == 0
        await _works_as_before(moved, 10)
    finally:
        moved.close()
    assert not _without_rowid(path)


async def test_a_rowid_ledger_works_as_an_old_one_does(tmp_path: Path) -> None:
    # The same operations on the new layout (the old file moved at open): one set of
    # queries serves both.
    path = tmp_path / "ledger.db"
    _old_layout(path, 10)
    ledger = Ledger.open(path, retention_seconds=3600, clock=Clock())
    try:
        assert ledger.layout_kept is None
        await _works_as_before(ledger, 10)
    finally:
        ledger.close()
    assert not _without_rowid(path)


def test_the_start_says_once_why_the_old_layout_stayed(
        caplog: pytest.LogCaptureFixture) -> None:
    from daemon.state.ledger import KeptLayout
    from daemon.wiring import _log_layout_kept

    for kept, why in [
            (KeptLayout(KeptReason.TOO_MANY_RECORDS, 70_000, None, None),
             "too many records to move at start"),
            (KeptLayout(KeptReason.NOT_ENOUGH_FREE_DISK, 10, 43_000, 1_000),
             "not enough free disk")]:
        caplog.clear()
        with caplog.at_level("WARNING", logger="buzz_broker"):
            _log_layout_kept(kept)
        [line] = [r for r in caplog.records if getattr(r, "buzz_event", None)
                  == "ledger.layout_kept"]
        fields = getattr(line, "buzz_fields")
        assert line.levelname == "WARNING" and fields["reason"] == kept.reason.value
        assert fields["records"] == kept.records
        assert why in fields["detail"] and "4 KiB page of its own" in fields["detail"]
        assert "a later start may move it" in fields["detail"]


def test_the_hot_queries_search_an_index() -> None:
    # begin's lookup and every write find a record by (pid, rid), the sweep by expiry:
    # each a search of a b-tree keyed so, never a scan of the table.
    conn = sqlite3.connect(":memory:")
    conn.executescript(_SCHEMA)
    by_key = "(pid=? AND rid=?)"
    plans = {sql: (" ".join(row[3] for row in conn.execute(f"EXPLAIN QUERY PLAN {sql}",
                                                            params).fetchall()), searched)
             for sql, params, searched in [
                 ("SELECT digest, state, pending, response, status, code FROM entries"
                  " WHERE pid = ? AND rid = ?", (1, b"k"), by_key),
                 ("SELECT 1 FROM entries AS e JOIN principals AS p ON p.id = e.pid"
                  " WHERE p.principal = ? AND e.rid = ?", ("a", b"k"), by_key),
                 ("SELECT pid, rid, charge FROM entries WHERE expires < ?", (1,),
                  "entries_by_expiry (expires<?)"),
                 ("DELETE FROM entries WHERE pid = ? AND rid = ?", (1, b"k"), by_key),
                 ("UPDATE entries SET state = 'final' WHERE pid = ? AND rid = ?", (1, b"k"),
                  by_key),
             ]}
    conn.close()
    for sql, (plan, searched) in plans.items():
        assert "SCAN entries" not in plan and searched in plan, (sql, plan)
