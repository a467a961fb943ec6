"""Retry protection outlives retention (issue 23 item 7), and refusals have their own share
(issue 22 M1), in the ledger alone.

- A record that asked for a tombstone (an action with effects that ran), or that held
  pending work or an indeterminate verdict, leaves (K, D) behind when it expires: the same
  digest is `Forgotten`, another is `Conflict`, and neither claims the key.
- A refusal charged to a credential expires without a tombstone, counts in that
  credential's share and not its agent's, and the charge survives a reopen.
- `reserve` makes the record before an outside effect: a retry sees `Fresh.recorded`.
- The measured cost of a tombstone on disk is within `TOMBSTONE_BYTES`, the figure the
  cap counts and docs/operations.md's sizing table uses.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from buzzwire.contract import ErrorCode, Status
from tests.ledger.test_ledger_disk import file_bytes
from daemon.state.ledger import (
    ROW_BYTES,
    STALE_FACTOR,
    TOMBSTONE_BYTES,
    Conflict,
    Forgotten,
    Fresh,
    Full,
    Ledger,
    LedgerKey,
    Resume,
)

AGENT = "a" * 64
RETENTION = 3600
T0 = 1_800_000_000


class Clock:
    def __init__(self) -> None:
        self.t = float(T0)

    def __call__(self) -> float:
        return self.t


def digest(body: bytes) -> bytes:
    return hashlib.sha256(body).digest()


def open_ledger(path: Path, clock: Clock, **caps: int) -> Ledger:
    return Ledger.open(path, retention_seconds=RETENTION, clock=clock, **caps)


async def test_an_effect_is_a_tombstone_after_retention(tmp_path: Path) -> None:
    clock = Clock()
    ledger = open_ledger(tmp_path / "l.db", clock)
    key = LedgerKey(AGENT, "post-1")
    begun = await ledger.begin(key, digest(b"body"))
    assert isinstance(begun, Fresh)
    await ledger.finish(begun.ticket, b'{"ok":1}', Status.SUCCEEDED, tombstone=True)
    # A read's record (no tombstone asked for) is forgotten as before.
    read = await ledger.begin(LedgerKey(AGENT, "read-1"), digest(b"read"))
    assert isinstance(read, Fresh)
    await ledger.finish(read.ticket, b'{"page":1}', Status.SUCCEEDED)
    clock.t += RETENTION + 1
    assert await ledger.sweep(int(clock.t)) == 2
    assert await ledger.begin(key, digest(b"body")) == Forgotten()
    assert await ledger.begin(key, digest(b"other body")) == Conflict()
    again = await ledger.begin(LedgerKey(AGENT, "read-1"), digest(b"read"))
    assert isinstance(again, Fresh) and not again.recorded
    ledger.release(again.ticket)
    # Tombstones count against the agent's account, and survive a reopen.
    assert ledger.usage(AGENT) == TOMBSTONE_BYTES
    ledger.close()
    reopened = open_ledger(tmp_path / "l.db", clock)
    assert reopened.usage(AGENT) == TOMBSTONE_BYTES
    assert await reopened.begin(key, digest(b"body")) == Forgotten()
    reopened.close()


async def test_pending_and_reserved_work_leave_tombstones(tmp_path: Path) -> None:
    clock = Clock()
    ledger = open_ledger(tmp_path / "l.db", clock)
    pending_key, reserved_key = LedgerKey(AGENT, "pending"), LedgerKey(AGENT, "reserved")
    begun = await ledger.begin(pending_key, digest(b"p"))
    assert isinstance(begun, Fresh)
    await ledger.record_pending(begun.ticket, b"events")
    ledger.release(begun.ticket)  # the daemon died mid-publish
    reserved = await ledger.begin(reserved_key, digest(b"r"))
    assert isinstance(reserved, Fresh)
    await ledger.reserve(reserved.ticket)
    ledger.release(reserved.ticket)  # died after minting, before the pending record
    retry = await ledger.begin(reserved_key, digest(b"r"))
    assert isinstance(retry, Fresh) and retry.recorded  # the minted key is this record's
    ledger.release(retry.ticket)
    resumed = await ledger.begin(pending_key, digest(b"p"))
    assert isinstance(resumed, Resume)
    ledger.release(resumed.ticket)
    clock.t += STALE_FACTOR * RETENTION + 1
    assert await ledger.sweep(int(clock.t)) == 2
    assert await ledger.begin(pending_key, digest(b"p")) == Forgotten()
    assert await ledger.begin(reserved_key, digest(b"r")) == Forgotten()
    ledger.close()


async def test_refusals_pay_from_their_credentials_share(tmp_path: Path) -> None:
    clock = Clock()
    cap = 4 * ROW_BYTES
    ledger = open_ledger(tmp_path / "l.db", clock, max_bytes_per_principal=cap,
                         max_refusal_bytes_per_credential=cap)
    answers = []
    for i in range(8):
        begun = await ledger.begin(LedgerKey(AGENT, f"bad-{i}"), digest(b"x"),
                                   credential="narrow")
        answers.append(begun)
        if isinstance(begun, Fresh):
            await ledger.finish(begun.ticket, b"\x00invalid_request", Status.FAILED,
                                ErrorCode.INVALID_REQUEST, refusal_of="narrow")
    assert Full(credential=True) in answers
    assert ledger.usage(AGENT) == 0 and ledger.refusal_usage(AGENT, "narrow") >= cap
    # The agent's other credentials are not turned away.
    wide = await ledger.begin(LedgerKey(AGENT, "good"), digest(b"y"), credential="wide")
    assert isinstance(wide, Fresh)
    ledger.release(wide.ticket)
    ledger.close()
    reopened = open_ledger(tmp_path / "l.db", clock, max_bytes_per_principal=cap,
                           max_refusal_bytes_per_credential=cap)
    assert reopened.usage(AGENT) == 0 and reopened.refusal_usage(AGENT, "narrow") >= cap
    # A refusal is no claim: it expires without a tombstone, and its share frees up.
    clock.t += RETENTION + 1
    await reopened.sweep(int(clock.t))
    assert reopened.refusal_usage(AGENT, "narrow") == 0
    fresh = await reopened.begin(LedgerKey(AGENT, "bad-0"), digest(b"x"), credential="narrow")
    assert isinstance(fresh, Fresh)
    reopened.release(fresh.ticket)
    assert await reopened.tombstones() == 0
    reopened.close()


async def test_a_tombstone_costs_tens_of_bytes(tmp_path: Path) -> None:
    """Disk per tombstone, measured on the file after a checkpoint: the figure in
    docs/operations.md's sizing table, and what the cap counts (`TOMBSTONE_BYTES`)."""
    clock = Clock()
    path = tmp_path / "l.db"
    ledger = open_ledger(path, clock)
    n = 20_000

    for i in range(50):  # the tables and the principal exist
        begun = await ledger.begin(LedgerKey(AGENT, f"w-{i}"), digest(b"w"))
        assert isinstance(begun, Fresh)
        await ledger.finish(begun.ticket, b'{"ok":1}', Status.SUCCEEDED, tombstone=True)
    clock.t += RETENTION + 1
    await ledger.sweep(int(clock.t))
    before = file_bytes(path)
    for i in range(n):
        begun = await ledger.begin(LedgerKey(AGENT, f"post-{i}"), digest(str(i).encode()))
        assert isinstance(begun, Fresh)
        await ledger.finish(begun.ticket, b'{"ok":1}', Status.SUCCEEDED, tombstone=True)
    clock.t += RETENTION + 1
    assert await ledger.sweep(int(clock.t)) == n
    per_tombstone = (file_bytes(path) - before) / n
    ledger.close()
    print(f"\ndisk per tombstone: {per_tombstone:.1f} bytes ({n} tombstones)")
    assert per_tombstone <= TOMBSTONE_BYTES


async def test_a_credentials_refusal_share_is_full_at_exactly_its_cap(tmp_path: Path) -> None:
    # The share used up to the byte is full, not one byte short of it (a mutation review:
    # `>=` as `>` passed every test).
    async def refuse(ledger: Ledger, request_id: str) -> None:
        begun = await ledger.begin(LedgerKey(AGENT, request_id), digest(b"x"),
                                   credential="narrow")
        assert isinstance(begun, Fresh)
        await ledger.finish(begun.ticket, b"\x00invalid_request", Status.FAILED,
                            ErrorCode.INVALID_REQUEST, refusal_of="narrow")

    probe = open_ledger(tmp_path / "probe.db", Clock())
    await refuse(probe, "bad-0")
    one = probe.refusal_usage(AGENT, "narrow")
    probe.close()
    ledger = open_ledger(tmp_path / "l.db", Clock(), max_refusal_bytes_per_credential=3 * one)
    for i in range(3):
        await refuse(ledger, f"bad-{i}")
    assert ledger.refusal_usage(AGENT, "narrow") == 3 * one
    full = await ledger.begin(LedgerKey(AGENT, "bad-3"), digest(b"x"), credential="narrow")
    assert full == Full(credential=True)
    ledger.close()
