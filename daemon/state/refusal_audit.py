"""Refusals in the audit log: one line each up to a burst, then counted (issue 13).

Rules:
- Every refusal is still a ledger record under (agent, requestId) with its digest and
  verdict (spec I3). What this module bounds is the *audit log's* share: a credential
  may have `BURST` refusals written one line each, refilled at `REFILL_PER_SECOND`; past
  that, refusals are counted per (credential, agent, action, code) and a `refusals` line
  (daemon/state/audit.py `RefusalCount`: the count and when the first was counted) is written
  once the first counted one is `WINDOW_SECONDS` old, and at shutdown. So a flood from
  one credential costs the log one ~330-byte line per key per window, not one per request.
- A refusal is a `failed` verdict that published nothing (validation, authorization,
  rate limit, conflict, the ledger cap, a fault before dispatch), a replayed one
  included. It discloses nothing and changed nothing, which is why it may be answered
  before its count is durable. Successes, reads and anything published are never counted:
  no audit, no answer holds for them (daemon/pipeline/broker.py).
- Lost on a crash (SIGKILL, power): the counts not yet written, at most
  `WINDOW_SECONDS` plus one flush interval (`WINDOW_SECONDS / 4`, the loop the two
  counters share: daemon/state/_flush_loop.py) of them. The ledger still holds each of
  those refusals.
- Memory: one bucket per credential that refused recently (full idle buckets are
  dropped at each flush) and one counter per key; both bounded by the credentials.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import trio

from buzzwire.contract import ErrorCode
from daemon.state.audit import AuditLog, AuditUnavailable, RefusalCount
from daemon.log import log_event
from daemon.state._flush_loop import flush_forever

__all__ = ["RefusalAudit", "BURST", "REFILL_PER_SECOND", "WINDOW_SECONDS"]

_log = logging.getLogger("buzz_broker.audit")

#: Refusals per credential written one line each before counting starts.
BURST: Final = 20
#: ... and how fast that allowance comes back (one line per 2 s sustained).
REFILL_PER_SECOND: Final = 0.5
#: A count is written once its first refusal is this old (and at shutdown).
WINDOW_SECONDS: Final = 60.0

_Key = tuple[str, str, str | None, ErrorCode]  # credential, agent, action, code


@dataclass(slots=True)
class _Count:
    since: float
    count: int


class RefusalAudit:
    """Decides per refusal: a line of its own, or a count (module docstring)."""

    def __init__(self, audit: AuditLog, clock: Callable[[], float], *, burst: int = BURST,
                 refill_per_second: float = REFILL_PER_SECOND,
                 window_seconds: float = WINDOW_SECONDS) -> None:
        self._audit = audit
        self._clock = clock
        self._burst = float(burst)
        self._refill = refill_per_second
        self._window = window_seconds
        self._buckets: dict[str, tuple[float, float]] = {}  # credential -> (level, at)
        self._counts: dict[_Key, _Count] = {}

    def admit(self, credential_id: str) -> bool:
        """True: write this refusal's own line. False: the caller calls `count` instead."""
        now = self._clock()
        level, at = self._buckets.get(credential_id, (self._burst, now))
        level = min(self._burst, level + max(0.0, now - at) * self._refill)
        if level >= 1.0:
            self._buckets[credential_id] = (level - 1.0, now)
            return True
        self._buckets[credential_id] = (level, now)
        return False

    def count(self, credential_id: str, agent: str, action: str | None, code: ErrorCode) -> None:
        """Count one refusal that got no line of its own."""
        key = (credential_id, agent, action, code)
        entry = self._counts.get(key)
        if entry is None:
            self._counts[key] = _Count(self._clock(), 1)
        else:
            entry.count += 1

    @property
    def counted(self) -> int:
        """Refusals counted and not yet written (tests, metrics)."""
        return sum(c.count for c in self._counts.values())

    async def flush(self, *, everything: bool = False) -> None:
        """Write the counts whose window has closed (all of them with `everything`).

        A count that cannot be written stays for the next flush (`audit.unavailable`).
        """
        now = self._clock()
        due = [key for key, c in self._counts.items()
               if everything or now - c.since >= self._window]
        for key in due:
            entry = self._counts.pop(key)
            credential_id, agent, action, code = key
            try:
                await self._audit.append(RefusalCount(
                    at=now, since=entry.since, credential_id=credential_id, agent=agent,
                    action=action, code=code, count=entry.count))
            except AuditUnavailable as exc:
                log_event(_log, "audit.unavailable", level=logging.ERROR, detail=exc.detail,
                          counted_refusals=entry.count)
                merged = self._counts.get(key)
                if merged is not None:
                    entry.count += merged.count
                self._counts[key] = entry
                return
        # Buckets that have refilled carry no state worth keeping.
        self._buckets = {
            cred: (level, at) for cred, (level, at) in self._buckets.items()
            if level + (now - at) * self._refill < self._burst}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Flush closed windows forever (a nursery task; cancel to stop)."""
        await flush_forever(self.flush, self._window, task_status=task_status)
