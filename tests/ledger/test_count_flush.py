"""The flush loop the audit's two counters share (daemon/state/_flush_loop.py).

- `test_the_loop_flushes_four_times_a_window`: `flush_forever` calls its flush every
  quarter window, from a quarter window after it started.
- `test_each_counter_writes_a_closed_window_within_one_flush_interval`: for the refusal
  and the read counter, a count stays while its window is open and is written within one
  flush interval of its close by the counter's own `run` (the loss bound both modules
  state); the line is in the log, with its count.
- `test_the_read_table_is_full_at_its_bound_and_written_whole`: the read counter holds at
  most `max_counters` (key, target) counters, a repeated target adding none and a key
  without targets one; at the bound it is `full` (the pipeline then writes it whole), and
  writing it empties it, each count in the log.
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
CHANNELS = [f"00000000-0000-4000-8000-00000000000{i}" for i in (1, 2, 3)]


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


async def test_the_read_table_is_full_at_its_bound_and_written_whole(tmp_path: Path) -> None:
    audit = AuditLog.open(tmp_path / "audit")
    reads = ReadAudit(audit, lambda: float(T0), window_seconds=WINDOW, max_counters=2)
    read = (CREDENTIAL, AGENT, "channel.read", Status.SUCCEEDED, None)
    try:
        reads.count(*read, CHANNELS[0])
        reads.count(*read, CHANNELS[0])  # the same target: the same counter
        assert not reads.full
        reads.count(*read, CHANNELS[1])  # a second counter: the bound of two reached
        assert reads.full
        await reads.flush(everything=True)
        assert not reads.full and reads.counted == 0
        # A key without targets holds one counter too.
        reads.count(CREDENTIAL, AGENT, "storage.address", Status.SUCCEEDED, None, None)
        assert not reads.full
        reads.count(*read, CHANNELS[2])
        assert reads.full
        await reads.flush(everything=True)
    finally:
        await audit.aclose()
    written = [r.record for r in read_records(tmp_path / "audit")]
    assert all(isinstance(r, ReadCount) for r in written)
    # The lines of one flush are appended together, in no set order.
    lines = sorted((r.action, r.count, sorted(r.targets))
                   for r in written)
    assert lines == [("channel.read", 1, [(CHANNELS[2], 1)]),
                     ("channel.read", 3, [(CHANNELS[0], 2), (CHANNELS[1], 1)]),
                     ("storage.address", 1, [])]
