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
    ROW_BYTES,
    Fresh,
    Full,
    Ledger,
    LedgerKey,
    Replay,
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
