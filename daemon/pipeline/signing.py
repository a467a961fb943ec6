"""Coalesce concurrent signing requests into one custody hop.

Theory of operation: every custody call is one hop to the single token worker thread, and
under load the hop, not the cryptography, is what a signature costs (benchmarks/custody.py:
about 2,400 signatures/s one hop each against about 5,800/s in hops of 64). So the
operations do not call custody directly: they hand their events to the `SigningBatcher`,
whose one task takes everything that is waiting — up to `MAX_EVENTS_PER_HOP` events — and
signs it in a single `Custody.sign_events` hop.

Rules:
- No timer. A request that arrives when nothing is running goes at once, so a lone agent
  waits no longer than before; batching only happens when requests queue up behind a hop.
- One caller's events stay together and in order (agents.create signs three at once).
- `Custody.sign_events` is all or nothing. When a batch fails, each caller's events are
  signed again on their own, so one agent's bad key never fails another agent's request,
  and each caller gets its own result or its own exception. Except when the custodian
  did not answer (`CustodianUnavailable`: gone, or hung until the client's deadline):
  that is nobody's events, and signing each alone would make the last caller wait one
  deadline per caller before it, so every caller gets that error at once.
- A caller cancelled while waiting leaves its events to be signed and discarded: signing
  has no side effect, and nothing unsigned is ever sent.

WARNING: `SigningBatcher.run` must be running (in the broker's nursery) before `sign` is
called; otherwise callers wait forever.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from buzzwire.nostr import SignedEvent, UnsignedEvent
from custody.custodian.client import CustodianClient, CustodianUnavailable

if TYPE_CHECKING:  # the facade loads the PKCS#11 binding: not where a custodian holds the keys
    from custody import Custody

__all__ = ["SigningBatcher", "MAX_EVENTS_PER_HOP"]

#: Events signed in one token hop at most. 64 is where the custody benchmark's batch rate
#: levels off; a larger hop only makes the callers at its front wait longer.
MAX_EVENTS_PER_HOP = 64

#: Callers queued before `sign` itself waits for room (back-pressure, not a drop).
QUEUE_DEPTH = 1024


@dataclass(eq=False)
class _Job:
    requests: Sequence[tuple[str, UnsignedEvent]]
    done: trio.Event = field(default_factory=trio.Event)
    signed: list[SignedEvent] | None = None
    error: Exception | None = None


class SigningBatcher:
    """The one way the daemon signs events: `await batcher.sign([(agent, unsigned), ...])`."""

    def __init__(self, custody: Custody | CustodianClient) -> None:
        self._custody = custody
        self._send, self._receive = trio.open_memory_channel[_Job](QUEUE_DEPTH)
        #: hops made and events signed, for tests and the benchmark
        self.hops = 0
        self.events = 0

    async def sign(self, requests: Sequence[tuple[str, UnsignedEvent]]) -> list[SignedEvent]:
        """Sign `requests` (in order, any agents) in the next hop that has room.

        Raises:
            whatever `Custody.sign_events` raises for these requests alone (UnknownAgent,
            UnsealFailed, ValueError for a malformed event).
        """
        if not requests:
            return []
        job = _Job(list(requests))
        await self._send.send(job)
        await job.done.wait()
        if job.error is not None:
            raise job.error
        assert job.signed is not None
        return job.signed

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Sign queued jobs until cancelled; `started()` once `sign` may be called."""
        task_status.started()
        async for job in self._receive:
            batch, size = [job], len(job.requests)
            while size < MAX_EVENTS_PER_HOP:
                try:
                    more = self._receive.receive_nowait()
                except trio.WouldBlock:
                    break
                batch.append(more)
                size += len(more.requests)
            await self._sign_batch(batch)

    async def _sign_batch(self, batch: list[_Job]) -> None:
        flat = [request for job in batch for request in job.requests]
        try:
            signed = await self._custody.sign_events(flat)
        except Exception as exc:  # noqa: BLE001 - handed to its callers, one by one
            if len(batch) == 1 or isinstance(exc, CustodianUnavailable):
                for job in batch:  # each its own exception: each is raised in its own task
                    job.error = exc if len(batch) == 1 else CustodianUnavailable(*exc.args)
                    job.done.set()
                return
            for job in batch:
                await self._sign_alone(job)
            return
        self.hops += 1
        self.events += len(flat)
        start = 0
        for job in batch:
            job.signed = signed[start:start + len(job.requests)]
            start += len(job.requests)
            job.done.set()

    async def _sign_alone(self, job: _Job) -> None:
        try:
            job.signed = await self._custody.sign_events(job.requests)
            self.hops += 1
            self.events += len(job.requests)
        except Exception as exc:  # noqa: BLE001 - handed to the one caller it belongs to
            job.error = exc
        finally:
            job.done.set()
