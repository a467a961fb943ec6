"""Reads in the audit log: counted per credential and window, never one line each (issue 24).

Rules:
- A read (channel.read, storage.address, storage.get) that ran has no effects and leaves
  no ledger record (daemon/pipeline/recorder.py, `keeping`). The audit log keeps a count
  of it under (credential, agent, action, status, code), with a count per target: the
  channel a channel.read read, the NIP-AE d tag a storage.get read (never the slug).
  A `reads` line (daemon/state/audit.py `ReadCount`) is written once the first counted
  read of its key is `WINDOW_SECONDS` old, and at shutdown. So a fleet polling around
  the clock costs the log one line per credential and action per window, whatever its
  rate: 64 agents polling 4 channels at 1 Hz write 64 lines a minute, not 15,360.
- Reads refused before they ran (validation, authorization, rate limits) are refusals:
  recorded and audited by daemon/state/refusal_audit.py's rules, not here.
- Memory is bounded here, not by what clients send: at most `MAX_COUNTERS` (key, target)
  counters are held; the read that finds the table full waits while everything held is
  written (`full`, then `flush(everything=True)`), so a client naming ever new channels
  costs lines, never memory.
- Lost on a crash (SIGKILL, power): the counts not yet written, at most `WINDOW_SECONDS`
  plus one flush interval (`WINDOW_SECONDS / 4`, the loop the two counters share:
  daemon/state/_flush_loop.py) of reads. What a read disclosed cannot be taken back, but
  nothing it did needs undoing.
- No audit, no answer, per window: a count that cannot be written is kept for the next
  flush. While the audit log's last write failed (`AuditLog.failing`), the pipeline
  counts no read: each one must have its own verdict line written, as every verdict
  did before, or be answered `failed` + `internal` (daemon/pipeline/recorder.py
  `counted`); the first line written ends that.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

import trio

from buzzwire.contract import ErrorCode, Status
from daemon.log import log_event
from daemon.state._flush_loop import flush_forever
from daemon.state.audit import MAX_READ_TARGETS, AuditLog, AuditUnavailable, ReadCount

__all__ = ["ReadAudit", "WINDOW_SECONDS", "MAX_COUNTERS"]

_log = logging.getLogger("buzz_broker.audit")

#: A count is written once its first read is this old (and at shutdown).
WINDOW_SECONDS: Final = 60.0
#: (key, target) counters held at most; a full table is written at once.
MAX_COUNTERS: Final = 4096

_Key = tuple[str, str, str, Status, ErrorCode | None]  # credential, agent, action, status, code


@dataclass(slots=True)
class _Count:
    since: float
    count: int = 0
    #: target -> count (empty for an action without a target: storage.address)
    targets: dict[str, int] = field(default_factory=dict)


class ReadAudit:
    """Counts the reads that ran and writes the counts (module docstring)."""

    def __init__(self, audit: AuditLog, clock: Callable[[], float], *,
                 window_seconds: float = WINDOW_SECONDS, max_counters: int = MAX_COUNTERS
                 ) -> None:
        self._audit = audit
        self._clock = clock
        self._window = window_seconds
        self._max = max_counters
        self._counts: dict[_Key, _Count] = {}
        self._held = 0  # counters held: one per key without targets, one per target

    @property
    def full(self) -> bool:
        """The table holds `MAX_COUNTERS` counters: write it before the next read is told."""
        return self._held >= self._max

    @property
    def counted(self) -> int:
        """Reads counted and not yet written (tests, metrics)."""
        return sum(c.count for c in self._counts.values())

    def count(self, credential_id: str, agent: str, action: str, status: Status,
              code: ErrorCode | None, target: str | None) -> None:
        """Count one read that ran."""
        self._add((credential_id, agent, action, status, code), self._clock(), 1,
                  {} if target is None else {target: 1})

    def _add(self, key: _Key, since: float, count: int, targets: dict[str, int]) -> None:
        entry = self._counts.get(key)
        before = 0 if entry is None else max(1, len(entry.targets))
        if entry is None:
            entry = self._counts[key] = _Count(since)
        entry.since = min(entry.since, since)
        entry.count += count
        for target, n in targets.items():
            entry.targets[target] = entry.targets.get(target, 0) + n
        self._held += max(1, len(entry.targets)) - before

    async def flush(self, *, everything: bool = False) -> None:
        """Write the counts whose window has closed (all of them with `everything`).

        The due counts leave the table before the first write, so two flushes at once
        never write one count twice; a line that cannot be written goes back into the
        table for the next flush (`audit.unavailable`; the log is then `failing`).
        """
        now = self._clock()
        due = [key for key, c in self._counts.items()
               if everything or now - c.since >= self._window]
        lines: list[tuple[_Key, ReadCount]] = []
        for key in due:
            entry = self._counts.pop(key)
            self._held -= max(1, len(entry.targets))
            lines.extend((key, line) for line in _lines(key, entry, now))
        if not lines:
            return
        failed: list[tuple[_Key, ReadCount]] = []

        async def write(key: _Key, line: ReadCount) -> None:
            try:
                await self._audit.append(line)
            except AuditUnavailable as exc:
                log_event(_log, "audit.unavailable", level=logging.ERROR, detail=exc.detail,
                          counted_reads=line.count)
                failed.append((key, line))

        # Appended together, the lines share one write and one fsync (group commit).
        async with trio.open_nursery() as nursery:
            for key, line in lines:
                nursery.start_soon(write, key, line)
        for key, line in failed:
            self._add(key, line.since, line.count, dict(line.targets))

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Flush closed windows forever (a nursery task; cancel to stop)."""
        await flush_forever(self.flush, self._window, task_status=task_status)


def _lines(key: _Key, entry: _Count, now: float) -> list[ReadCount]:
    """The `reads` lines of one count: one, or one per `MAX_READ_TARGETS` targets."""
    credential_id, agent, action, status, code = key
    targets = sorted(entry.targets.items())
    if not targets:
        return [ReadCount(at=now, since=entry.since, credential_id=credential_id, agent=agent,
                          action=action, status=status, code=code, count=entry.count)]
    chunks = [tuple(targets[i:i + MAX_READ_TARGETS])
              for i in range(0, len(targets), MAX_READ_TARGETS)]
    return [ReadCount(at=now, since=entry.since, credential_id=credential_id, agent=agent,
                      action=action, status=status, code=code,
                      count=sum(n for _t, n in chunk), targets=chunk) for chunk in chunks]
