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
at open: a restart's gap is the downtime, or a bad RTC), then each believed reading. A
wall clock up to `SLACK_SECONDS` past the steady one is believed (it becomes the
reference). Further ahead, the sweep uses the steady time plus the slack instead, and the
hold begins (`Reading.hold_began`: the caller logs one line); once the wall clock has read
ahead for `HOLD_SECONDS` of monotonic time it is believed. A wall clock behind the steady
one is believed at once: it deletes less. With no reference (an empty ledger) the first
reading is believed.

So a clock read ahead for less than a day sweeps nothing early but the slack, with or
without requests recorded meanwhile, and the sweep goes on at the steady pace, keeping the
ledger bounded. A true jump (a daemon stopped for weeks, a VM resumed after a long pause, a
clock set right forward) is a day's hold: records that expired meanwhile are deleted a day
late, those that had expired by the reference at once. A clock ahead for longer than a day is
believed (then it is the host's time, and time-sync.target is the unit's guard at boot).
Alternatives: comparing with the last sweep's time alone never sweeps after a long
downtime; clamping to the newest record's time is fooled by the records written while the
clock is ahead.

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

#: How far the wall clock may read past a steady one and be believed at once: an hour,
#: the sweep's interval. A record goes at most this early; NTP's slew (500 ppm at most) is
#: under 2 s an hour, and a restart within the hour after the newest record holds nothing.
SLACK_SECONDS: Final = 3600

#: How long the wall clock must read further ahead before it is believed: a day, against
#: the 7-day retention. An excursion shorter than that sweeps nothing early; a true jump
#: leaves expired records a day longer.
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
    #: the steady clock still starts from the newest record's time (nothing believed since
    #: the ledger was opened): the gap may be the downtime, not a step
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
        self._ahead_since: float | None = None
        self._believed = False

    def read(self) -> Reading:
        """The time for the sweep about to run."""
        wall, mono = self._wall(), self._monotonic()
        if self._reference is None:
            return self._believe(wall, mono)
        ref_wall, ref_mono = self._reference
        limit = ref_wall + (mono - ref_mono) + SLACK_SECONDS
        if wall <= limit:
            return self._believe(wall, mono)
        began = self._ahead_since is None
        if self._ahead_since is None:
            self._ahead_since = mono
        elif mono - self._ahead_since >= HOLD_SECONDS:
            return self._believe(wall, mono)
        return Reading(now=int(limit), held=int(wall - limit), hold_began=began,
                       since_open=not self._believed)

    def _believe(self, wall: float, mono: float) -> Reading:
        self._reference = (wall, mono)
        self._ahead_since = None
        self._believed = True
        return Reading(now=int(wall), held=0, hold_began=False, since_open=False)
