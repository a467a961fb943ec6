"""Rate-bounded logging of faults: once per cause, then a count, never a flood.

Why: a fault a client can trigger at will (a request that trips a bug, a refused
connection) would otherwise write one log line per attempt, and logs are one more disk an
attacker can fill. So every fault goes through `FaultLog.record(cause, **fields)`:

- The first occurrence of a cause is logged at once, with its fields.
- Later occurrences of the same cause within `interval` seconds are only counted; the next
  occurrence after the interval logs one line carrying ``suppressed`` = how many were not
  logged in between. So a cause costs at most one line per interval, whatever its rate.
- Causes are a bounded set: past `max_causes` distinct causes, new ones share the single
  cause ``"other"`` (with its own interval), so an attacker who can vary the cause (an
  exception type, a uid) still cannot multiply the lines. A cause quiet for a whole
  interval with nothing counted is forgotten when the table is full (its next
  occurrence would be logged at once anyway), so over a long life the table holds the
  recent causes, not the first ones ever seen.

A cause is a short tuple of public words (where the fault happened, an exception's type
name, a uid): never an exception's text, which may quote a secret. The clock is injectable
for tests; production uses `time.monotonic`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass

from daemon.log import log_event

__all__ = ["FaultLog", "FaultLogs", "DEFAULT_INTERVAL", "DEFAULT_MAX_CAUSES"]

#: At most one line per cause per minute after the first.
DEFAULT_INTERVAL = 60.0
#: Distinct causes remembered; a daemon has a few dozen fault sites, not thousands.
DEFAULT_MAX_CAUSES = 64

_OTHER = ("other",)


@dataclass(slots=True)
class _Cause:
    last_logged: float
    suppressed: int = 0


class FaultLog:
    """Logs `event` for each cause at most once per `interval` (see the module docstring)."""

    def __init__(
        self,
        logger: logging.Logger,
        event: str,
        *,
        level: int = logging.ERROR,
        interval: float = DEFAULT_INTERVAL,
        max_causes: int = DEFAULT_MAX_CAUSES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._event = event
        self._level = level
        self._interval = interval
        self._max_causes = max_causes
        self._clock = clock
        self._causes: dict[Hashable, _Cause] = {}
        #: Every fault recorded, logged or not (for metrics and tests).
        self.total = 0

    def record(self, cause: tuple[Hashable, ...], /, **fields: object) -> bool:
        """Count one fault of `cause`; log it unless its cause was logged within the interval.

        `cause` is positional-only, so a line may carry a field named `cause` itself (the
        unauthenticated line does: why the credential was refused).

        Returns:
            True when a line was written.
        """
        self.total += 1
        now = self._clock()
        key: Hashable = cause
        if key not in self._causes and len(self._causes) >= self._max_causes:
            self._causes = {k: c for k, c in self._causes.items()
                            if c.suppressed or now - c.last_logged < self._interval}
            if len(self._causes) >= self._max_causes:
                key = _OTHER
        entry = self._causes.get(key)
        if entry is None:
            self._causes[key] = _Cause(last_logged=now)
            log_event(self._logger, self._event, level=self._level, **fields)
            return True
        if now - entry.last_logged < self._interval:
            entry.suppressed += 1
            return False
        suppressed, entry.suppressed, entry.last_logged = entry.suppressed, 0, now
        log_event(self._logger, self._event, level=self._level, suppressed=suppressed, **fields)
        return True


class FaultLogs:
    """A `FaultLog` per event of a table (event -> level): a part's whole set of lines
    that someone else can make as frequent as they like, recorded by event name."""

    __slots__ = ("_logs",)

    def __init__(self, logger: logging.Logger, levels: Mapping[str, int], *,
                 max_causes: int = DEFAULT_MAX_CAUSES) -> None:
        self._logs = {event: FaultLog(logger, event, level=level, max_causes=max_causes)
                      for event, level in levels.items()}

    def record(self, event: str, /, *cause: Hashable, **fields: object) -> bool:
        """`FaultLog.record` of `event`'s log, its cause the words after the event."""
        return self._logs[event].record(cause, **fields)

    def total(self, event: str) -> int:
        """How many times `event` happened, logged or not."""
        return self._logs[event].total
