"""The ledger's retention sweep under a wall clock that steps (daemon/state/sweep_clock.py):
a real ledger, the wall and monotonic clocks injected.

- A wall clock read days ahead (a bad RTC, a wrong time source), with requests recorded
  meanwhile, sweeps nothing that had not expired by a steady clock; set right within the
  hold, the identical retries find their records: `Resume` for the indeterminate publish
  (its signed event is still held), `Replay` for the finished one. (Before: one sweep 15
  days ahead deleted both; both retries got `Forgotten`.)
- The sweep still happens: under a steady clock on schedule, and after the daemon was
  stopped for three weeks (what had expired by the newest record at once, the rest after
  the day's hold). A clock stepped back is believed at once; one ahead for longer than the
  hold is believed then.
- A wall clock gaining under the slack at every sweep adds up against the steady clock:
  held once past it, and never believed while it gains. NTP's drift, set right by steps,
  never holds; small forward steps again and again hold once they pass the slack in all.
- Through the daemon's sweeper (daemon/wiring.py), the wall clock it reads 15 days ahead:
  one `ledger.sweep_held` line, and the records are kept.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from buzzwire.contract import ACTIONS, Status
from daemon import wiring
from daemon.metrics import Metrics
from daemon.state.ledger import Fresh, Ledger, LedgerKey
from daemon.state.sweep_clock import HOLD_SECONDS, SLACK_SECONDS, SweepClock

AGENT = "a" * 64
DAY = 86400
#: The shipped `[state] ledger_retention`, 7 days.
RETENTION = 7 * DAY
T0 = 1_796_040_000
HOUR = 3600


class Clocks:
    """The host's wall clock and a monotonic one, moved by the test."""

    def __init__(self) -> None:
        self.wall = float(T0)
        self.mono = 1000.0

    def pass_time(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds

    def sweep_clock(self, ledger: Ledger) -> SweepClock:
        return SweepClock(ledger.newest_record_time, wall=lambda: self.wall,
                          monotonic=lambda: self.mono)


def digest(body: bytes) -> bytes:
    return hashlib.sha256(body).digest()


INDETERMINATE = LedgerKey(AGENT, "post-1")
FINISHED = LedgerKey(AGENT, "post-2")


#: The test's clocks, and a ledger whose records they date (`clocked`).
Clocked = tuple[Clocks, Ledger]


@pytest.fixture
def clocked(tmp_path: Path) -> Iterator[Clocked]:
    """Test clocks, and a ledger whose records they date."""
    clocks = Clocks()
    ledger = Ledger.open(tmp_path / "ledger.db", retention_seconds=RETENTION,
                         clock=lambda: clocks.wall)
    try:
        yield clocks, ledger
    finally:
        ledger.close()


async def _publish_two(ledger: Ledger) -> None:
    """An indeterminate publish holding its signed event, and a finished one."""
    begun = await ledger.begin(INDETERMINATE, digest(b"1"))
    assert isinstance(begun, Fresh)
    await ledger.record_pending(begun.ticket, b'["signed event 1"]')
    await ledger.finish(begun.ticket, b"indeterminate", Status.INDETERMINATE)
    begun = await ledger.begin(FINISHED, digest(b"2"))
    assert isinstance(begun, Fresh)
    await ledger.finish(begun.ticket, b'{"eventId":"e2"}', Status.SUCCEEDED, tombstone=True)


async def _retries(ledger: Ledger) -> tuple[str, str]:
    """The identical retries of both, as the agent sends them; their answers' kinds."""
    first = await ledger.begin(INDETERMINATE, digest(b"1"))
    second = await ledger.begin(FINISHED, digest(b"2"))
    for begun in (first, second):
        ticket = getattr(begun, "ticket", None)
        if ticket is not None:
            ledger.release(ticket)
    return type(first).__name__, type(second).__name__


async def _sweep(ledger: Ledger, clock: SweepClock) -> int:
    """One round of the daemon's sweeper."""
    return await ledger.sweep(clock.read().now)


async def test_a_clock_read_ahead_sweeps_nothing_early(clocked: Clocked) -> None:
    clocks, ledger = clocked
    await _publish_two(ledger)
    sweeps = clocks.sweep_clock(ledger)
    assert await _sweep(ledger, sweeps) == 0
    # An hour later the clock reads 15 days ahead, and stays so for 23 hours: requests
    # are recorded by it meanwhile, and the hourly sweeps run.
    clocks.pass_time(HOUR)
    clocks.wall += 15 * DAY
    first = sweeps.read()
    assert first.hold_began and not first.since_open
    assert first.now == T0 + HOUR + SLACK_SECONDS
    assert first.held == 15 * DAY - SLACK_SECONDS
    assert await ledger.sweep(first.now) == 0
    for i in range(22):
        later = await ledger.begin(LedgerKey(AGENT, f"during-{i}"), digest(b"%d" % i))
        assert isinstance(later, Fresh)
        await ledger.finish(later.ticket, b'{"eventId":"x"}', Status.SUCCEEDED,
                            tombstone=True)
        clocks.pass_time(HOUR)
        reading = sweeps.read()
        assert not reading.hold_began and reading.held > 0
        assert await ledger.sweep(reading.now) == 0
    # Set right: the identical retries, a minute later by the true clock.
    clocks.wall -= 15 * DAY
    clocks.pass_time(60)
    assert await _sweep(ledger, sweeps) == 0
    assert await _retries(ledger) == ("Resume", "Replay")


async def test_without_the_clock_the_same_sweep_loses_both(clocked: Clocked) -> None:
    """The control: `sweep(now)` itself deletes what expired by the `now` it is given (a
    review's reproduction, as the daemon's sweeper ran it before); what keeps the daemon
    from giving it a wrong one is the sweeper's clock above."""
    clocks, ledger = clocked
    await _publish_two(ledger)
    assert await ledger.sweep(T0 + 15 * DAY) == 2
    clocks.pass_time(60)
    assert await _retries(ledger) == ("Forgotten", "Forgotten")


async def test_a_steady_clock_sweeps_on_schedule(clocked: Clocked) -> None:
    """Hourly sweeps under a steady clock delete each record within the hour after it
    expires: the final one after the retention, the indeterminate one after twice it."""
    clocks, ledger = clocked
    await _publish_two(ledger)
    sweeps = clocks.sweep_clock(ledger)
    swept: dict[int, int] = {}
    for hour in range(2 * 7 * 24 + 2):
        removed = await _sweep(ledger, sweeps)
        if removed:
            swept[hour] = removed
        clocks.pass_time(HOUR)
    assert swept == {7 * 24 + 1: 1, 2 * 7 * 24 + 1: 1}
    assert await ledger.count() == 0


async def test_a_daemon_stopped_for_three_weeks_still_sweeps(tmp_path: Path) -> None:
    """Started again three weeks after its newest record, the daemon cannot tell the gap
    from a clock read ahead: it deletes at once what had expired by the newest record (and
    the hour's slack), and the rest after the day's hold; its hourly sweeps go on."""
    clocks = Clocks()
    path = tmp_path / "ledger.db"
    ledger = Ledger.open(path, retention_seconds=RETENTION, clock=lambda: clocks.wall)
    old = await ledger.begin(LedgerKey(AGENT, "old"), digest(b"old"))
    assert isinstance(old, Fresh)
    await ledger.finish(old.ticket, b'{"eventId":"e0"}', Status.SUCCEEDED, tombstone=True)
    clocks.pass_time(8 * DAY)  # the old one has expired when the newest are written
    await _publish_two(ledger)
    ledger.close()
    clocks.wall += 21 * DAY
    clocks.mono = 5.0  # a new boot
    ledger = Ledger.open(path, retention_seconds=RETENTION, clock=lambda: clocks.wall)
    try:
        assert ledger.newest_record_time == T0 + 8 * DAY
        sweeps = clocks.sweep_clock(ledger)
        first = sweeps.read()
        assert first.hold_began and first.since_open
        assert await ledger.sweep(first.now) == 1  # the old one
        for _ in range(23):
            clocks.pass_time(HOUR)
            assert await _sweep(ledger, sweeps) == 0
        clocks.pass_time(HOUR)
        reading = sweeps.read()
        assert reading.held == 0 and reading.now == int(clocks.wall)
        assert await ledger.sweep(reading.now) == 2  # both had expired: a day late
    finally:
        ledger.close()


async def test_a_clock_stepped_back_is_believed_at_once(clocked: Clocked) -> None:
    clocks, ledger = clocked
    await _publish_two(ledger)
    sweeps = clocks.sweep_clock(ledger)
    clocks.pass_time(HOUR)
    clocks.wall -= 2 * DAY
    reading = sweeps.read()
    assert (reading.now, reading.held) == (int(clocks.wall), 0)
    assert await ledger.sweep(reading.now) == 0
    # From there it runs steady: the final record goes once the clock reaches its
    # expiry, two days later than the true time.
    clocks.pass_time(RETENTION + 2 * DAY)
    assert await _sweep(ledger, sweeps) == 1


async def test_a_clock_ahead_for_longer_than_the_hold_is_believed(clocked: Clocked) -> None:
    """The limit: a wall clock that stays ahead for a day of monotonic time is the host's
    time from then on (a clock set right forward, a VM resumed after a long pause)."""
    clocks, ledger = clocked
    await _publish_two(ledger)
    sweeps = clocks.sweep_clock(ledger)
    assert await _sweep(ledger, sweeps) == 0
    clocks.wall += 15 * DAY
    assert sweeps.read().hold_began
    clocks.pass_time(HOLD_SECONDS - 1)
    assert sweeps.read().held > 0
    clocks.pass_time(1)
    assert sweeps.read().held == 0
    assert await _sweep(ledger, sweeps) == 2


async def test_a_clock_gaining_under_the_slack_at_every_sweep_is_held(clocked: Clocked) -> None:
    """A wall clock that gains 50 minutes every hour (a review's reproduction; the daemon's
    first round at start added). Each reading is within the slack of the one before, but
    the gains add up against the steady clock: held from the second hour, one hold line,
    and never believed while it gains, so the final record goes no earlier than the slack
    before its retention by the true time. (Before: each reading became the reference, the
    hold never began, and the record went after 3.8 days.)"""
    clocks, ledger = clocked
    begun = await ledger.begin(LedgerKey(AGENT, "done"), digest(b"x"))
    assert isinstance(begun, Fresh)
    await ledger.finish(begun.ticket, b'{"eventId":"e"}', Status.SUCCEEDED, tombstone=True)
    sweeps = clocks.sweep_clock(ledger)
    assert await _sweep(ledger, sweeps) == 0  # the round at start
    holds, elapsed = 0, 0
    while True:
        clocks.pass_time(HOUR)
        clocks.wall += 50 * 60
        elapsed += HOUR
        reading = sweeps.read()
        holds += reading.hold_began
        assert elapsed < 2 * HOUR or reading.held > 0
        if await ledger.sweep(reading.now):
            break
    assert holds == 1
    assert elapsed >= RETENTION - SLACK_SECONDS


def test_ntp_drift_set_right_by_steps_never_holds() -> None:
    """60 days of hourly sweeps, the wall clock gaining 2 s an hour on the monotonic one
    (far beyond NTP's 500 ppm slew), set right by NTP: not for the first 30 days, then by a
    step back each day. No reading is held, and none is ahead of the true (monotonic) time
    by more than the slack."""
    clocks = Clocks()
    sweeps = SweepClock(T0, wall=lambda: clocks.wall, monotonic=lambda: clocks.mono)
    start_mono = clocks.mono
    for hour in range(1, 60 * 24 + 1):
        clocks.pass_time(HOUR)
        clocks.wall += 2
        true_time = T0 + (clocks.mono - start_mono)
        if hour == 30 * 24 or (hour > 30 * 24 and hour % 24 == 0):
            clocks.wall = true_time  # NTP steps it back
        reading = sweeps.read()
        assert (reading.held, reading.hold_began) == (0, False), hour
        assert true_time <= reading.now <= true_time + SLACK_SECONDS, hour


def test_small_forward_steps_add_up_to_one_hold() -> None:
    """The limit: a wall clock stepped forward 2 s every hour against the monotonic one (a
    VM losing ticks, set right by NTP steps) reads past the slack after 75 days; it is
    held then, and believed a day later (its lead moved 48 s, within the slack), so 160
    days hold twice, a day each time."""
    clocks = Clocks()
    sweeps = SweepClock(T0, wall=lambda: clocks.wall, monotonic=lambda: clocks.mono)
    began, held = [], 0
    for hour in range(1, 160 * 24 + 1):
        clocks.pass_time(HOUR)
        clocks.wall += 2
        reading = sweeps.read()
        if reading.hold_began:
            began.append(hour)
        held += reading.held > 0
    assert began == [1801, 2 * 1801 + 24]
    assert held == 2 * 24


async def test_the_daemons_sweeper_holds_a_clock_read_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """daemon/wiring.py's sweeper, its wall clock (`time.time`) reading 15 days ahead when
    its first round runs (a daemon started on a bad RTC): one `ledger.sweep_held` line,
    nothing swept; the retries find their records. (Before: `ledger.swept` removed=2, and
    both retries were `Forgotten`.) A hold that begins later, in a running daemon, is a
    warning (`since` `last_sweep`: ::test_a_held_clock_in_a_running_daemon_is_a_warning)."""
    caplog.set_level(logging.INFO)
    path = tmp_path / "ledger.db"
    seeded = Ledger.open(path, retention_seconds=RETENTION)
    await _publish_two(seeded)
    seeded.close()
    ledger = Ledger.open(path, retention_seconds=RETENTION)
    real = time.time
    try:
        monkeypatch.setattr(time, "time", lambda: real() + 15 * DAY)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wiring._sweep_forever, ledger, Metrics(actions=ACTIONS))
            with trio.fail_after(20):
                while not any(getattr(r, "buzz_event", None) in ("ledger.sweep_held",
                                                                 "ledger.swept")
                              for r in caplog.records):
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        monkeypatch.setattr(time, "time", real)
        events = [getattr(r, "buzz_event", None) for r in caplog.records]
        assert "ledger.swept" not in events
        [held] = [r for r in caplog.records if getattr(r, "buzz_event", None) == "ledger.sweep_held"]
        # Its first round measures from the newest record: a downtime looks the same.
        assert held.levelno == logging.INFO
        fields = getattr(held, "buzz_fields")
        assert fields["since"] == "newest_record" and fields["ahead"] > 14 * DAY
        assert await _retries(ledger) == ("Resume", "Replay")
    finally:
        ledger.close()


async def test_a_held_clock_in_a_running_daemon_is_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """The sweeper's first round believes the clock; then it reads 15 days ahead: one
    warning, `since` `last_sweep`, however many rounds the hold lasts."""
    caplog.set_level(logging.INFO)
    ledger = Ledger.open(tmp_path / "ledger.db", retention_seconds=RETENTION)
    await _publish_two(ledger)
    real = time.time
    ahead = [0.0]
    monkeypatch.setattr(time, "time", lambda: real() + ahead[0])
    monkeypatch.setattr(wiring, "SWEEP_INTERVAL_SECONDS", 0.01)
    metrics = Metrics(actions=ACTIONS)
    rounds = [0]
    counted = metrics.set_ledger_size

    def count_round(size: int) -> None:
        rounds[0] += 1
        counted(size)

    monkeypatch.setattr(metrics, "set_ledger_size", count_round)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wiring._sweep_forever, ledger, metrics)
            with trio.fail_after(20):
                while rounds[0] < 2:
                    await trio.sleep(0.01)
                ahead[0] = 15 * DAY
                seen = rounds[0]
                while rounds[0] < seen + 5:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        monkeypatch.setattr(time, "time", real)
        held = [r for r in caplog.records if getattr(r, "buzz_event", None) == "ledger.sweep_held"]
        assert [(r.levelno, getattr(r, "buzz_fields")["since"]) for r in held] == [
            (logging.WARNING, "last_sweep")]
        assert await _retries(ledger) == ("Resume", "Replay")
    finally:
        ledger.close()
