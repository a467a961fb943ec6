"""The flush loop the audit's two counters share (daemon/state/_flush_loop.py).

- `test_the_loop_flushes_four_times_a_window`: `flush_forever` calls its flush every
  quarter window, from a quarter window after it started.
- `test_each_counter_writes_a_closed_window_within_one_flush_interval`: for the refusal
  and the read counter, a count stays while its window is open and is written within one
  flush interval of its close by the counter's own `run` (the loss bound both modules
  state); the line is in the log, with its count.
Virtual time (autojump_clock); the audit log is a real one in tmp_path.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from buzzwire.contract import ErrorCode, Status
from daemon.state._flush_loop import FLUSHES_PER_WINDOW, flush_forever
from daemon.state.audit import AuditLog, ReadCount, RefusalCount, read_records
from daemon.state.read_audit import ReadAudit
from daemon.state.refusal_audit import RefusalAudit

AGENT = "a" * 64
CREDENTIAL = "cred_" + "1" * 16
T0 = 1_800_000_000
WINDOW = 60.0


async def test_the_loop_flushes_four_times_a_window(
        autojump_clock: trio.testing.MockClock) -> None:
    start = trio.current_time()
    calls: list[float] = []

    async def flush() -> None:
        calls.append(trio.current_time() - start)

    async with trio.open_nursery() as nursery:
        await nursery.start(flush_forever, flush, WINDOW)
        await trio.sleep(WINDOW + 1)
        nursery.cancel_scope.cancel()
    step = WINDOW / FLUSHES_PER_WINDOW
    assert calls == [pytest.approx(step * n) for n in range(1, FLUSHES_PER_WINDOW + 1)]


@pytest.mark.parametrize("counter", ["refusals", "reads"])
async def test_each_counter_writes_a_closed_window_within_one_flush_interval(
        counter: str, tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    audit = AuditLog.open(tmp_path / "audit")

    def clock() -> float:
        return T0 + trio.current_time()

    counts: RefusalAudit | ReadAudit
    if counter == "refusals":
        counts = RefusalAudit(audit, clock, window_seconds=WINDOW)
        counts.count(CREDENTIAL, AGENT, None, ErrorCode.UNAUTHORIZED)
    else:
        counts = ReadAudit(audit, clock, window_seconds=WINDOW)
        counts.count(CREDENTIAL, AGENT, "storage.address", Status.SUCCEEDED, None, None)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(counts.run)
            await trio.sleep(WINDOW - 1)
            assert counts.counted == 1  # its window is open: kept
            await trio.sleep(1 + WINDOW / FLUSHES_PER_WINDOW)
            assert counts.counted == 0  # closed, and a flush since: taken to be written
            nursery.cancel_scope.cancel()  # the write in hand finishes (its thread is kept)
    finally:
        await audit.aclose()
    written = [r.record for r in read_records(tmp_path / "audit")]
    kind = RefusalCount if counter == "refusals" else ReadCount
    assert len(written) == 1 and isinstance(written[0], kind) and written[0].count == 1
