"""Which time the ledger's retention sweep may believe: the wall clock, unless it reads
far past where a steady clock would.

`Ledger.sweep(now)` deletes every record that expired by `now`. The daemon sweeps at start
and then every hour (daemon/wiring.py), and `now` is the wall clock, which can step. A
clock read 8 days ahead for one sweep deleted every final record (an identical retry got
`Forgotten` instead of its replay); 15 days ahead, every indeterminate one too, with the
signed events it held for the retry (never published). Nothing a record holds says the
clock was wrong: records written while it was are dated by it.

Theory of operation: a *steady* clock reads a reference wall time plus the monotonic time
since. The reference is first the ledger's newest record's time (`newest_record_time`, read
at open: a restart's gap is the downtime, or a bad RTC), then each reading not ahead of the
steady clock, and a reading believed after a hold. A wall clock up to `SLACK_SECONDS` past
the steady one is used for that sweep, and the reference stays: forward steps add up
against the steady clock. (Made the reference, such a reading was the line the next one
was measured from, and a clock gaining under the slack at each sweep carried the sweep
with it, never held: a final record under the 7-day retention went after 3.8 days.)
Further ahead, the sweep uses the steady time plus the slack instead, and the hold begins
(`Reading.hold_began`: the caller logs one line). A wall clock that has then read ahead
steadily, its lead over the steady clock moving by no more than the slack, for
`HOLD_SECONDS` of monotonic time is believed: that is a jump. A lead that moves further
begins the hold again, silently, so a clock that keeps gaining is never believed and the
sweep goes on at the steady pace. A wall clock behind the steady one is believed at once:
it deletes less. With no reference (an empty ledger) the first reading is believed.

So a clock read ahead for less than a day, or gaining for any time, sweeps nothing early
but the slack, with or without requests recorded meanwhile, and the sweep goes on at the
steady pace, keeping the ledger bounded. A true jump (a daemon stopped for weeks, a VM
resumed after a long pause, a clock set right forward) is a day's hold: records that
expired meanwhile are deleted a day late, those that had expired by the reference at once.
A clock ahead by the same amount for longer than a day is believed (then it is the host's
time, and time-sync.target is the unit's guard at boot). NTP's slew moves the monotonic
clock with the wall clock (the kernel disciplines both; only a step parts them), and a step
back re-anchors the reference: neither ever holds. Small forward steps again and again (a
VM losing ticks, set right by NTP steps) add up: once past the slack in all they are held,
and believed a day later (at 2 s an hour, one hold every 75 days).
Alternatives: comparing with the last sweep's time alone never sweeps after a long
downtime; clamping to the newest record's time is fooled by the records written while the
clock is ahead; letting a reading within the slack move the reference is the ratchet above.

The monotonic clock is CLOCK_BOOTTIME (Linux, the daemon's platform): it never steps, and
it counts a suspended host's sleep, which is time that really passed.

WARNING: docs/operations.md ("The sweep and the wall clock") states `SLACK_SECONDS` and
`HOLD_SECONDS`, and daemon/wiring.py's sweeper logs `ledger.sweep_held` by `Reading`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

__all__ = ["SweepClock", "Reading", "SLACK_SECONDS", "HOLD_SECONDS", "boottime"]

#: How far the wall clock may read past a steady one and still be used: an hour, the
#: sweep's interval. A record goes at most this early; a restart within the hour after the
#: newest record holds nothing, nor do a running host's forward steps until they add up to
#: this (NTP's slew, 500 ppm at most, moves both clocks alike).
SLACK_SECONDS: Final = 3600

#: How long the wall clock must read further ahead, its lead steady within the slack,
#: before it is believed: a day, against the 7-day retention. An excursion shorter than that
#: sweeps nothing early; a true jump leaves expired records a day longer.
HOLD_SECONDS: Final = 86400


def boottime() -> float:
    """Seconds of a clock that never steps and counts a suspended host's sleep."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


@dataclass(frozen=True, slots=True, kw_only=True)
class Reading:
    """What one sweep may use."""

    #: the time the sweep deletes up to
    now: int
    #: seconds the wall clock read past `now` (0: believed)
    held: int
    #: this reading began a hold: the caller says so once
    hold_began: bool
    #: no sweep has used the wall clock since the ledger was opened (the steady clock
    #: starts from the newest record's time): the gap may be the downtime, not a step
    since_open: bool


class SweepClock:
    """The time a sweep may believe (module docstring). One per running sweeper."""

    def __init__(self, newest_record_time: int | None, *, wall: Callable[[], float],
                 monotonic: Callable[[], float] = boottime) -> None:
        """Args:
            newest_record_time: `Ledger.newest_record_time` (None: an empty ledger).
            wall: the wall clock (`time.time`).
            monotonic: a clock that never steps (tests inject both).
        """
        self._wall = wall
        self._monotonic = monotonic
        mono = monotonic()
        self._reference = None if newest_record_time is None else (
            float(newest_record_time), mono)
        #: while held: (monotonic time the hold began or began again, the lead then)
        self._hold: tuple[float, float] | None = None
        #: a sweep has used the wall clock (`Reading.since_open` is its negation)
        self._believed = False

    def read(self) -> Reading:
        """The time for the sweep about to run."""
        wall, mono = self._wall(), self._monotonic()
        if self._reference is None:
            return self._believe(wall, mono)
        ref_wall, ref_mono = self._reference
        steady = ref_wall + (mono - ref_mono)
        lead = wall - steady
        if lead <= 0:
            return self._believe(wall, mono)
        if lead <= SLACK_SECONDS:
            # Used, and the reference stays: believed, a reading a little ahead would
            # become the line the next one is measured from, and a clock gaining under
            # the slack each sweep would carry the sweep with it, never held.
            self._hold = None
            self._believed = True
            return Reading(now=int(wall), held=0, hold_began=False, since_open=False)
        began = self._hold is None
        if self._hold is None or abs(lead - self._hold[1]) > SLACK_SECONDS:
            # A hold begins, or begins again (silently) because the lead moved by more than
            # the slack: only a clock that runs with the steady one, a jump, is believed.
            self._hold = (mono, lead)
        elif mono - self._hold[0] >= HOLD_SECONDS:
            return self._believe(wall, mono)
        return Reading(now=int(steady + SLACK_SECONDS), held=int(lead - SLACK_SECONDS),
                       hold_began=began, since_open=not self._believed)

    def _believe(self, wall: float, mono: float) -> Reading:
        self._reference = (wall, mono)
        self._hold = None
        self._believed = True
        return Reading(now=int(wall), held=0, hold_began=False, since_open=False)
