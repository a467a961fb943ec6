"""The idempotency ledger against a real SQLite file: states, in-flight dedup, conflicts,
crash recovery (a real SIGKILL), retention."""

from __future__ import annotations

import hashlib
import itertools
import signal
import sqlite3
import stat
import subprocess
import sys
import textwrap
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

import trio

from buzzwire.contract import ErrorCode, Status

from daemon.state.ledger import (
    STALE_FACTOR,
    TRANSITIONS,
    Conflict,
    Fresh,
    Ledger,
    LedgerEvent,
    LedgerKey,
    Replay,
    Resume,
    RolledBack,
    State,
    advance,
)

RETENTION = 7 * 24 * 3600
REPO = Path(__file__).resolve().parents[2]


def digest(body: bytes) -> bytes:
    return hashlib.sha256(body).digest()


async def _fresh(ledger: Ledger, body: bytes = b"x") -> tuple[LedgerKey, Fresh]:
    """Begin the one key these tests share, with `body`'s digest; the caller owns it."""
    key = LedgerKey("a" * 64, "req")
    owner = await ledger.begin(key, digest(body))
    assert isinstance(owner, Fresh)
    return key, owner


class Clock:
    def __init__(self, t: float = 1_800_000_000) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def ledger(tmp_path: Path, clock: Clock) -> Iterator[Ledger]:
    lg = Ledger.open(tmp_path / "ledger.db", retention_seconds=RETENTION, clock=clock)
    yield lg
    lg.close()


# -- the transition table, row by row (style.md #7) ---------------------------------


@pytest.mark.parametrize(("pair", "after"), list(TRANSITIONS.items()), ids=str)
def test_every_transition_row(pair: tuple[State, LedgerEvent], after: State) -> None:
    assert advance(*pair) is after


def test_every_missing_pair_is_a_bug() -> None:
    missing = [p for p in itertools.product(State, LedgerEvent) if p not in TRANSITIONS]
    for state, event in missing:
        with pytest.raises(AssertionError):
            advance(state, event)
    # Final is final; pending work is written once; nothing returns to NEW.
    assert {e for s, e in missing if s is State.FINAL} == set(LedgerEvent)
    assert (State.PENDING, LedgerEvent.RECORD_PENDING) in missing
    assert State.NEW not in TRANSITIONS.values()


# -- the pipeline's use, as a tiny scripted executor ---------------------------------


async def execute(
    ledger: Ledger,
    key: LedgerKey,
    body: bytes,
    prepare: Callable[[], bytes],
    publish: Callable[[bytes], Awaitable[bytes]],
) -> tuple[str, bytes]:
    """What the broker does around one publishing operation (ledger → execute → record)."""
    begun = await ledger.begin(key, digest(body))
    if isinstance(begun, Replay):
        return "replay", begun.response
    if isinstance(begun, Conflict):
        return "conflict", b""
    try:
        if isinstance(begun, Fresh):
            pending = prepare()
            await ledger.record_pending(begun.ticket, pending)
        else:
            pending = begun.pending
        response = await publish(pending)
        await ledger.finish(begun.ticket, response, Status.SUCCEEDED)
        return "executed", response
    finally:
        ledger.release(begun.ticket)


async def test_fresh_then_replay_identical_bytes(ledger: Ledger) -> None:
    key = LedgerKey("a" * 64, "req-1")
    begun = await ledger.begin(key, digest(b"body"))
    assert isinstance(begun, Fresh)
    await ledger.finish(begun.ticket, b'{"verdict":1}', Status.SUCCEEDED)
    again = await ledger.begin(key, digest(b"body"))
    assert again == Replay(b'{"verdict":1}', Status.SUCCEEDED)


async def test_two_principals_same_request_id_are_independent(ledger: Ledger) -> None:
    a, b = LedgerKey("a" * 64, "shared-id"), LedgerKey("b" * 64, "shared-id")
    first = await ledger.begin(a, digest(b"A's body"))
    assert isinstance(first, Fresh)
    await ledger.finish(first.ticket, b"A's verdict", Status.SUCCEEDED)
    # B, with the same requestId and even A's exact bytes, gets a fresh execution.
    second = await ledger.begin(b, digest(b"A's body"))
    assert isinstance(second, Fresh)
    await ledger.finish(second.ticket, b"B's verdict", Status.SUCCEEDED)
    assert await ledger.begin(a, digest(b"A's body")) == Replay(b"A's verdict", Status.SUCCEEDED)
    assert await ledger.begin(b, digest(b"A's body")) == Replay(b"B's verdict", Status.SUCCEEDED)
    assert await ledger.count() == 2


async def test_hundred_concurrent_identical_one_execution(ledger: Ledger) -> None:
    key = LedgerKey("a" * 64, "burst")
    body = b'{"the":"request"}'
    prepared: list[int] = []
    published: list[bytes] = []

    def prepare() -> bytes:
        prepared.append(1)
        return b"signed-event-1"

    async def publish(pending: bytes) -> bytes:
        published.append(pending)
        await trio.sleep(0.01)  # the relay round trip; everyone else piles up meanwhile
        return b'{"status":"succeeded"}'

    results: list[tuple[str, bytes]] = []

    async def one() -> None:
        results.append(await execute(ledger, key, body, prepare, publish))

    async with trio.open_nursery() as nursery:
        for _ in range(100):
            nursery.start_soon(one)
    assert len(prepared) == 1 and published == [b"signed-event-1"]
    assert sorted(kind for kind, _ in results) == ["executed"] + ["replay"] * 99
    assert {resp for _, resp in results} == {b'{"status":"succeeded"}'}
    # Fewer transactions than requests: the waiters did not each go to disk.
    assert ledger.commits < 20


async def test_conflict_in_flight_and_recorded_original_untouched(ledger: Ledger) -> None:
    key, owner = await _fresh(ledger, b"original")
    # While in flight: a different digest is refused at once, without waiting.
    with trio.fail_after(1):
        assert await ledger.begin(key, digest(b"originaL")) == Conflict()
    await ledger.record_pending(owner.ticket, b"pending")
    await ledger.finish(owner.ticket, b"the verdict", Status.SUCCEEDED)
    assert await ledger.begin(key, digest(b"originaL")) == Conflict()
    assert await ledger.begin(key, digest(b"original")) == Replay(b"the verdict", Status.SUCCEEDED)


async def test_indeterminate_is_not_final(ledger: Ledger) -> None:
    key, owner = await _fresh(ledger)
    await ledger.record_pending(owner.ticket, b"signed event")
    await ledger.finish(owner.ticket, b"indeterminate verdict", Status.INDETERMINATE)
    retry = await ledger.begin(key, digest(b"x"))
    assert isinstance(retry, Resume) and retry.pending == b"signed event"
    # The pending work is write-once: a retry re-sends, it never re-signs.
    with pytest.raises(AssertionError):
        await ledger.record_pending(retry.ticket, b"a new signature")
    await ledger.finish(retry.ticket, b"succeeded verdict", Status.SUCCEEDED)
    assert await ledger.begin(key, digest(b"x")) == Replay(b"succeeded verdict", Status.SUCCEEDED)


async def test_indeterminate_without_pending_runs_fresh(ledger: Ledger) -> None:
    key, owner = await _fresh(ledger)
    await ledger.finish(owner.ticket, b"internal, mid-way", Status.INDETERMINATE)
    retry = await ledger.begin(key, digest(b"x"))
    assert isinstance(retry, Fresh)
    await ledger.record_pending(retry.ticket, b"now signed")
    await ledger.finish(retry.ticket, b"done", Status.SUCCEEDED)
    assert await ledger.begin(key, digest(b"other")) == Conflict()


async def test_a_rolled_back_record_is_never_resumed(ledger: Ledger) -> None:
    """The relay refused the first event: the failed verdict is durable before the
    rollback runs. A crash then (release, no finish) leaves it rolled back, never pending:
    the retry gets `RolledBack` (run the rollback again, record the stored verdict), not
    `Resume`. An indeterminate finish (the rollback could not be finished) writes nothing;
    a final one makes it a replay. Waiters meanwhile wait, then replay."""
    key, owner = await _fresh(ledger)
    await ledger.record_pending(owner.ticket, b"signed events")
    await ledger.roll_back(owner.ticket, b"failed: refused", Status.FAILED,
                           ErrorCode.ACTION_FAILED)
    ledger.release(owner.ticket)  # died before the verdict
    retry = await ledger.begin(key, digest(b"x"))
    assert isinstance(retry, RolledBack), retry
    assert (retry.pending, retry.response, retry.status, retry.code) == (
        b"signed events", b"failed: refused", Status.FAILED, ErrorCode.ACTION_FAILED)
    await ledger.finish(retry.ticket, b"indeterminate: internal", Status.INDETERMINATE)
    again = await ledger.begin(key, digest(b"x"))
    assert isinstance(again, RolledBack) and again.response == b"failed: refused"
    waiter: list[object] = []

    async def wait() -> None:
        waiter.append(await ledger.begin(key, digest(b"x")))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        await ledger.finish(again.ticket, again.response, again.status, again.code)
    replay = Replay(b"failed: refused", Status.FAILED, ErrorCode.ACTION_FAILED)
    assert waiter == [replay]
    assert await ledger.begin(key, digest(b"x")) == replay
    assert await ledger.tombstones() == 1


async def test_only_pending_work_is_rolled_back_and_only_as_failed(ledger: Ledger) -> None:
    key, owner = await _fresh(ledger)
    with pytest.raises(AssertionError):  # nothing was ever to be sent
        await ledger.roll_back(owner.ticket, b"failed", Status.FAILED)
    await ledger.record_pending(owner.ticket, b"signed")
    with pytest.raises(AssertionError):  # only `failed` promises the rollback's meaning
        await ledger.roll_back(owner.ticket, b"ok", Status.SUCCEEDED)
    ledger.release(owner.ticket)
    resumed = await ledger.begin(key, digest(b"x"))
    assert isinstance(resumed, Resume)
    with pytest.raises(AssertionError):  # a resumed record may be on the relay already
        await ledger.roll_back(resumed.ticket, b"failed", Status.FAILED)


async def test_release_wakes_waiters_and_one_resumes(ledger: Ledger) -> None:
    key, owner = await _fresh(ledger)
    await ledger.record_pending(owner.ticket, b"signed")
    outcomes: list[object] = []

    async def waiter() -> None:
        begun = await ledger.begin(key, digest(b"x"))
        outcomes.append(begun)
        if isinstance(begun, Resume):
            await ledger.finish(begun.ticket, b"verdict", Status.SUCCEEDED)

    async with trio.open_nursery() as nursery:
        for _ in range(5):
            nursery.start_soon(waiter)
        await trio.sleep(0.01)
        assert outcomes == []  # all waiting on the owner
        ledger.release(owner.ticket)  # e.g. the owner's task was cancelled
    resumes = [o for o in outcomes if isinstance(o, Resume)]
    assert len(resumes) == 1 and resumes[0].pending == b"signed"
    assert [o for o in outcomes if not isinstance(o, Resume)] == [Replay(b"verdict", Status.SUCCEEDED)] * 4


async def test_joins_says_whether_begin_will_wait_for_an_owner(ledger: Ledger) -> None:
    """The broker authenticates a request again after a wait (NIP-BA: the release of a
    stored result is authorized too); `joins` is how it knows one is coming."""
    key = LedgerKey("a" * 64, "req")
    assert not ledger.joins(key)
    _key, owner = await _fresh(ledger)
    assert ledger.joins(key) and not ledger.joins(LedgerKey("a" * 64, "other"))
    await ledger.finish(owner.ticket, b"v", Status.SUCCEEDED)
    assert not ledger.joins(key)
    assert await ledger.begin(key, digest(b"x")) == Replay(b"v", Status.SUCCEEDED)
    assert not ledger.joins(key)  # a replay claims nothing


async def test_cancelled_waiter_leaves_no_trace(ledger: Ledger) -> None:
    key, owner = await _fresh(ledger)
    with trio.move_on_after(0.01):
        await ledger.begin(key, digest(b"x"))
    await ledger.finish(owner.ticket, b"v", Status.SUCCEEDED)
    assert await ledger.begin(key, digest(b"x")) == Replay(b"v", Status.SUCCEEDED)


async def test_stale_ticket_is_refused(ledger: Ledger) -> None:
    key, owner = await _fresh(ledger)
    await ledger.finish(owner.ticket, b"v", Status.SUCCEEDED)
    with pytest.raises(AssertionError):
        await ledger.finish(owner.ticket, b"again", Status.SUCCEEDED)
    with pytest.raises(AssertionError):
        await ledger.record_pending(owner.ticket, b"late")
    ledger.release(owner.ticket)  # harmless after finish
    assert await ledger.begin(key, digest(b"x")) == Replay(b"v", Status.SUCCEEDED)


async def test_bad_digest_is_a_bug(ledger: Ledger) -> None:
    with pytest.raises(ValueError):
        await ledger.begin(LedgerKey("a", "r"), b"short")


def test_files_are_private(tmp_path: Path) -> None:
    lg = Ledger.open(tmp_path / "ledger.db", retention_seconds=60)
    try:
        for name in ("ledger.db", "ledger.db-wal", "ledger.db-shm"):
            p = tmp_path / name
            if p.exists():
                assert stat.S_IMODE(p.stat().st_mode) == 0o600, name
    finally:
        lg.close()
    with pytest.raises(ValueError):
        Ledger.open(tmp_path, retention_seconds=60)


async def test_sweep_keeps_the_database_bounded(ledger: Ledger, clock: Clock) -> None:
    t0 = int(clock.t)
    for i in range(50):
        begun = await ledger.begin(LedgerKey("a" * 64, f"final-{i}"), digest(b"x"))
        assert isinstance(begun, Fresh)
        await ledger.finish(begun.ticket, b"v", Status.SUCCEEDED)
    for i in range(5):
        begun = await ledger.begin(LedgerKey("a" * 64, f"pending-{i}"), digest(b"x"))
        assert isinstance(begun, Fresh)
        await ledger.record_pending(begun.ticket, b"signed")
        if i % 2:
            await ledger.finish(begun.ticket, b"?", Status.INDETERMINATE)
        else:
            ledger.release(begun.ticket)  # a crash, as far as the ledger can tell
    assert await ledger.count() == 55
    # Within retention nothing goes.
    assert await ledger.sweep(t0 + RETENTION - 1) == 0
    # Past retention the final verdicts go; the pending/indeterminate ones stay.
    assert await ledger.sweep(t0 + RETENTION + 1) == 50
    assert await ledger.count() == 5
    resumed = await ledger.begin(LedgerKey("a" * 64, "pending-0"), digest(b"x"))
    assert isinstance(resumed, Resume)
    # An owner in flight is never swept, however old.
    assert await ledger.sweep(t0 + STALE_FACTOR * RETENTION + 1) == 4
    assert await ledger.count() == 1
    ledger.release(resumed.ticket)
    assert await ledger.sweep(t0 + STALE_FACTOR * RETENTION + 1) == 1
    assert await ledger.count() == 0


# -- a real crash: SIGKILL between the pending commit and the verdict ------------------

_CHILD = textwrap.dedent(
    """
    import hashlib, os, signal, sys
    import trio
    from daemon.state.ledger import Fresh, Ledger, LedgerKey

    async def main(path):
        ledger = Ledger.open(path, retention_seconds=3600)
        begun = await ledger.begin(LedgerKey("a" * 64, "crash-1"), hashlib.sha256(b"body").digest())
        assert isinstance(begun, Fresh)
        await ledger.record_pending(begun.ticket, b"the one signed event")
        # The relay is next; the process dies first, leaving no verdict behind.
        os.kill(os.getpid(), signal.SIGKILL)

    trio.run(main, sys.argv[1])
    """
)


async def test_sigkill_after_pending_resumes_with_the_recorded_event(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    proc = await trio.run_process(
        [sys.executable, "-c", _CHILD, str(path)],
        cwd=REPO,
        check=False,
        capture_stderr=True,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    ledger = Ledger.open(path, retention_seconds=3600)
    try:
        sent: list[bytes] = []

        def prepare() -> bytes:
            raise AssertionError("a retry must not prepare (sign) new events")

        async def publish(pending: bytes) -> bytes:
            sent.append(pending)
            return b'{"status":"succeeded","duplicate":true}'

        key = LedgerKey("a" * 64, "crash-1")
        assert await ledger.begin(key, digest(b"body!")) == Conflict()
        kind, response = await execute(ledger, key, b"body", prepare, publish)
        assert kind == "executed" and sent == [b"the one signed event"]
        kind, again = await execute(ledger, key, b"body", prepare, publish)
        assert (kind, again) == ("replay", response) and len(sent) == 1
    finally:
        ledger.close()


async def test_database_fault_reaches_the_caller_and_claims_nothing(
    ledger: Ledger, tmp_path: Path
) -> None:
    key, owner = await _fresh(ledger)
    await ledger.record_pending(owner.ticket, b"signed")
    # Break the table under the ledger (a disk fault stands in for this): the verdict
    # cannot be recorded, the caller sees the database error, and the key is released.
    other = sqlite3.connect(tmp_path / "ledger.db")
    other.execute("DROP TABLE entries")
    other.commit()
    other.close()
    with pytest.raises(sqlite3.Error):
        await ledger.finish(owner.ticket, b"v", Status.SUCCEEDED)
    # Not owned any more: a new begin() goes to the database (and fails) instead of waiting.
    with trio.fail_after(2), pytest.raises(sqlite3.Error):
        await ledger.begin(key, digest(b"x"))
