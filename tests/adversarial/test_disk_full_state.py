"""A full state disk at the durable state's own housekeeping: the ledger's sweep, the
audit log's cut of a failed write.

Invariants:
- The hourly ledger sweep on a full disk fails that round only: one `ledger.fault` line per
  round (step `sweep`), no traceback, and the daemon's tasks go on; once space is back the
  next round sweeps. (Before: the `sqlite3.OperationalError` ended the daemon's nursery,
  and a restart with the disk still full ended again at the first round.)
- A short audit write (ENOSPC part-way) leaves nothing of its records in the file once its
  callers are told it failed: no later batch and no `aclose` is needed for that, so a kill
  at that moment cannot leave records whose verdicts were answered "failed" as valid,
  chained lines. (Before: the cut waited for the next batch.)

The full disk is a real one: `small_disk` (a 4 MiB tmpfs, tests/adversarial/test_resources.py;
needs root, skipped otherwise), filled to the last byte by `_fill`.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import time
from pathlib import Path

import pytest
import trio

from buzzwire.contract import ACTIONS, ErrorCode, Status
from daemon import wiring
from daemon.metrics import Metrics
from daemon.state.audit import (AuditLog, AuditRecord, AuditUnavailable, BodyDigest, Phase,
                                 read_records, verify)
from daemon.state.ledger import Fresh, Ledger, LedgerKey
from tests.adversarial.test_resources import _fill, small_disk  # noqa: F401 - the fixture

AGENT = "a" * 64


def _events(caplog: pytest.LogCaptureFixture, name: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "buzz_event", None) == name]


async def test_a_full_disk_at_the_ledger_sweep_is_logged_and_tried_again(
    small_disk: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    path = small_disk / "ledger.db"
    old = time.time() - 10_000
    seeded = Ledger.open(path, retention_seconds=60, clock=lambda: old)
    for i in range(200):  # expired refusals: the sweep has pages of deletes to write
        begun = await seeded.begin(LedgerKey(AGENT, f"req-{i}"),
                                   hashlib.sha256(b"%d" % i).digest())
        assert isinstance(begun, Fresh)
        await seeded.finish(begun.ticket, b'{"x":1}' * 20, Status.FAILED, ErrorCode.UNAUTHORIZED)
    seeded.close()
    ledger = Ledger.open(path, retention_seconds=60)
    filler = _fill(small_disk)
    monkeypatch.setattr(wiring, "SWEEP_INTERVAL_SECONDS", 0.05)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wiring._sweep_forever, ledger, Metrics(actions=ACTIONS))
            with trio.fail_after(20):
                # The first round is the one a restart on a still-full disk runs at once.
                while len(_events(caplog, "ledger.fault")) < 2:
                    await trio.sleep(0.01)
            filler.unlink()
            with trio.fail_after(20):
                while not _events(caplog, "ledger.swept"):
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        faults = _events(caplog, "ledger.fault")
        assert {(getattr(r, "buzz_fields")["step"], getattr(r, "buzz_fields")["error"])
                for r in faults} == {("sweep", "OperationalError")}
        assert not any(r.exc_info or r.exc_text for r in caplog.records)
        assert getattr(_events(caplog, "ledger.swept")[0], "buzz_fields")["removed"] == 200
        assert await ledger.count() == 0
    finally:
        ledger.close()


def _record(i: int) -> AuditRecord:
    return AuditRecord(phase=Phase.VERDICT, at=time.time(), credential_id="cred_" + "0" * 16,
                       agent=AGENT, action="channel.read", request_id=f"req-{i}",
                       body=BodyDigest.mac(hashlib.sha256(b"%d" % i).hexdigest()),
                       status=Status.SUCCEEDED, code=None)


async def test_a_short_audit_write_is_cut_before_its_callers_hear_failed(
    small_disk: Path,
) -> None:
    directory = small_disk / "audit"
    log = AuditLog.open(directory)
    await log.append(_record(0))
    # tmpfs hands out whole pages: the file's last page still has room for a few lines, so
    # the batch below is written in part (whole lines of it) before ENOSPC.
    _fill(small_disk)
    told: dict[int, str] = {}

    async def one(i: int) -> None:
        try:
            await log.append(_record(i))
            told[i] = "durable"
        except AuditUnavailable:
            told[i] = "failed"

    async with trio.open_nursery() as nursery:
        for i in range(1, 41):
            nursery.start_soon(one, i)
    assert "failed" in told.values()
    durable = {f"req-{i}" for i, what in told.items() if what == "durable"} | {"req-0"}
    # Before any later batch or aclose: what a kill -9 now would leave behind.
    lines = list(read_records(directory))
    assert all(isinstance(line.record, AuditRecord) for line in lines), lines[-1]  # none torn
    in_file = [line.record.request_id for line in lines if isinstance(line.record, AuditRecord)]
    assert set(in_file) == durable and len(in_file) == log.head[0], (in_file, told)
    await log.aclose()
    assert verify(directory).ok


async def test_a_failed_cut_of_a_short_audit_write_is_made_at_close(
    small_disk: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """The cut right after the short write fails too (scripted: ftruncate raises EIO while
    the disk is full); with no batch after it, `aclose` makes it."""
    directory = small_disk / "audit"
    log = AuditLog.open(directory)
    await log.append(_record(0))
    filler = _fill(small_disk)
    real_ftruncate = os.ftruncate
    refusing = True

    def ftruncate(fd: int, length: int) -> None:
        if refusing:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_ftruncate(fd, length)

    monkeypatch.setattr(os, "ftruncate", ftruncate)
    failed = 0

    async def one(i: int) -> None:
        nonlocal failed
        try:
            await log.append(_record(i))
        except AuditUnavailable:
            failed += 1

    async with trio.open_nursery() as nursery:
        for i in range(1, 41):
            nursery.start_soon(one, i)
    assert failed
    assert any("truncate failed" in str(getattr(r, "buzz_fields", {}).get("detail"))
               for r in caplog.records)
    refusing = False
    filler.unlink()
    head = log.head
    await log.aclose()
    lines = list(read_records(directory))
    assert all(isinstance(line.record, AuditRecord) for line in lines), lines[-1]
    assert len(lines) == head[0] and verify(directory).head == head[1]
