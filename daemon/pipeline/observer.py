"""The observer queue: signed kind 24200 events taken in by observer.emit, paced to the relay.

Theory of operation (NIP-BA "Live signals"; issue 23 item 3):

- observer.emit's `accepted` is intake for best-effort publication, not relay delivery. The
  operation hands this queue events that are already encrypted to the owner and signed
  (the queue never holds a plaintext), and the queue admits each one that fits.
- Bounded by configuration, never by what a client sends ([observer]): every event is
  counted by the bytes of its relay frame; all queued events together stay within
  `max_queued_bytes`, and one credential's within `max_queued_bytes_per_credential` (its
  *share*). A frame that does not fit is not admitted, and the operation does not count it.
  A flood from one credential fills its own share and nothing else, so another
  credential's frames still get in (the total is sized for many full shares). An event
  larger than the relay takes (`max_event_bytes`, of its JSON) is not admitted either: it
  could only be refused there.
- Held until recorded: a request's admitted events are *held* under a key only that
  request owns (the pipeline's ledger ticket, `ObserverIntake.hold_key`: not the
  requestId, which another credential's request outside its scope shares under another
  ledger record) and the pacer does not see them until the pipeline has recorded the
  verdict and calls `settle(keep=True)` with that key. A verdict that turned into failed + internal (no audit record), a
  fault or a cancellation settles with `keep=False` and the events are dropped: NIP-BA's
  `failed` promises no effects, and a crash before the record leaves nothing published, so
  the retry that then runs afresh cannot put the same frames on the relay twice. A replay
  never reaches the operation, so it never enqueues again.
- Room set aside before the work (`reserve`): observer.emit works out each frame's relay
  frame bytes before anything is encrypted (`frame_bytes`: the same count `hold` charges)
  and reserves them under its hold key; it encrypts and signs only the frames reserved,
  so custody never makes an event the queue would turn away. The reservation counts
  against the share like held events (two concurrent requests cannot both spend the same
  room), `hold` replaces it with the events, and `settle` frees whatever is left of it.
  So what custody signs for observer.emit is bounded by what the queue drains: the
  pacer's `publish_per_second`, plus one fill of each share.
- Paced and fair: `run` hands at most `publish_per_second` events a second to the relay,
  at most `max_in_flight` awaiting their OK at once, taking one event per credential in
  turn (round robin), so a credential with a deep queue waits its turn like the others.
- Within its agent's relay quotas: a relay such as Buzz's counts these events against
  their author's own quotas (every EVENT of the pubkey, its posts and typing too), and
  answers one past them with a NOTICE and no OK. So one agent's events go out no faster
  than `publish_per_minute_per_agent`, evenly spaced (`_Pace`), and with at most one of
  them awaiting its OK: an agent whose frames get no OK keeps one `max_in_flight` slot,
  not all of them, and the others' events go on. A credential whose next event's agent
  must wait is passed over for the turn; its events wait in its share, and past the
  share observer.emit admits no more (the rule above), nothing is dropped for the pace.
- Best effort after intake: a relay refusal, no OK or no connection drops the event (an
  operator log line, no content, and a metric); nothing is retried. A relay that refuses
  every frame would make that `publish_per_second` lines a second: `_LINES`, one a
  minute per agent and outcome, then a count. NIP-BA allows it:
  "Drops after intake remain possible." A daemon that stops drops what is queued.

Resource handling: `run` is a background task owned by the nursery in daemon/wiring.py
(the daemon's serve); it spawns its publications into a nursery of its own, so they end
with it.

WARNING: `settle` must follow every `reserve` and `hold` (the broker does it in a
`finally`); a held batch or a reservation never settled would stay counted against its
credential's share.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

import trio

from buzzwire import kinds
from buzzwire.nostr import SignedEvent
from daemon.config import ObserverConfig
from daemon.fault_log import FaultLogs
from daemon.relay.pool import Accepted, PublishResult
from daemon.relay.protocol import encode_event, quote_reason
from daemon.state.observer_seq import ObserverSeq

__all__ = ["ObserverQueue", "ObserverIntake", "HoldKey", "KIND_OBSERVER_FRAME", "frame_bytes"]

_log = logging.getLogger("buzz_broker.observer")
#: What the pacer logs about a frame it could not publish, at what level.
_LINES: Final[Mapping[str, int]] = {
    "observer.dropped": logging.WARNING,
    "observer.publish_fault": logging.ERROR,
}

#: NIP-AO: the Agent Observer Frame, an ephemeral kind (relays do not persist it).
KIND_OBSERVER_FRAME: Final = kinds.OBSERVER_FRAME

#: What one request's held events are kept under: something only that request owns (the
#: broker's ledger `Ticket`, compared by identity), never a key another request can name.
HoldKey = Hashable

Publish = Callable[[str, SignedEvent], Awaitable[PublishResult]]

#: `["EVENT",` and `]` around the event's JSON in its relay frame.
_FRAME_OVERHEAD: Final = len('["EVENT",]')


def frame_bytes(event: SignedEvent) -> int:
    """What one event counts against its share: the UTF-8 bytes of its relay frame."""
    return len(encode_event(event).encode("utf-8"))


@dataclass(frozen=True, slots=True)
class _Item:
    credential_id: str
    agent: str
    event: SignedEvent
    size: int


@dataclass(slots=True)
class _Counts:
    """What the queue did, for tests and the metrics (never contents)."""

    admitted: int = 0
    refused: int = 0
    dropped_unsettled: int = 0
    published: int = 0
    failed: int = 0


@dataclass(slots=True)
class _Share:
    ready: deque[_Item] = field(default_factory=deque)
    bytes: int = 0


class ObserverQueue:
    """The bounded, per-credential, paced queue of kind 24200 events (module docstring)."""

    def __init__(self, config: ObserverConfig, publish: Publish) -> None:
        self._config = config
        self._publish = publish
        self._shares: dict[str, _Share] = {}
        self._held: dict[HoldKey, list[_Item]] = {}
        #: hold key -> (credential, bytes) set aside by `reserve`, until `hold` or `settle`
        self._reserved: dict[HoldKey, tuple[str, int]] = {}
        self._turns: deque[str] = deque()  # credentials with ready events, in turn order
        self._total = 0
        self._pace = _Pace(60.0 / config.publish_per_minute_per_agent)
        self._wake = trio.Event()
        self.counts = _Counts()
        self._lines = FaultLogs(_log, _LINES)

    # ------------------------------------------------------------------ intake

    def room(self, credential_id: str) -> int:
        """Bytes this credential could still queue now (its share, within the total)."""
        share = self._shares.get(credential_id)
        used = share.bytes if share is not None else 0
        return max(0, min(self._config.max_queued_bytes_per_credential - used,
                          self._config.max_queued_bytes - self._total))

    def _fits(self, share: _Share, size: int) -> bool:
        """Whether an event of `size` frame bytes may join `share` now (module docstring)."""
        return (size - _FRAME_OVERHEAD <= self._config.max_event_bytes
                and share.bytes + size <= self._config.max_queued_bytes_per_credential
                and self._total + size <= self._config.max_queued_bytes)

    def reserve(self, key: HoldKey, credential_id: str, sizes: Sequence[int | None]
                ) -> tuple[bool, ...]:
        """Set room aside for events not made yet, under `key`, until `hold` or `settle`.

        Args:
            key: the hold key of the request that will hand the events in.
            credential_id: whose share the room is taken from.
            sizes: in frame order, each event's `frame_bytes` (None: a frame that will not
                be an event; it is not reserved, and keeps its place).

        Returns:
            Per size, whether its room was set aside: exactly the events `hold` would admit
            now, in the same order, so the caller makes only those.

        Raises:
            ValueError: `key` already holds events or a reservation (our bug).
        """
        if key in self._held or key in self._reserved:
            raise ValueError("a request's room is already reserved or its events held")
        share = self._shares.setdefault(credential_id, _Share())
        taken: list[bool] = []
        reserved = 0
        for size in sizes:
            fits = size is not None and self._fits(share, size)
            taken.append(fits)
            if fits:
                assert size is not None
                share.bytes += size
                self._total += size
                reserved += size
        if reserved:
            self._reserved[key] = (credential_id, reserved)
        elif not share.bytes and not share.ready:
            self._shares.pop(credential_id, None)
        return tuple(taken)

    def _unreserve(self, key: HoldKey) -> None:
        """Give back what `reserve` set aside under `key`, if anything."""
        reservation = self._reserved.pop(key, None)
        if reservation is None:
            return
        credential_id, reserved = reservation
        share = self._shares[credential_id]
        share.bytes -= reserved
        self._total -= reserved
        if not share.bytes and not share.ready:
            del self._shares[credential_id]

    def hold(self, key: HoldKey, credential_id: str, agent: str,
             events: Sequence[SignedEvent | None]) -> tuple[bool, ...]:
        """Admit each event that fits, held under `key` until `settle`.

        Args:
            key: the hold key of the request handing the events in (`HoldKey`).
            credential_id: whose share the events count against.
            agent: the author, whose relay connection publishes them.
            events: in frame order; None stands for a frame the operation already could
                not turn into an event (it is not admitted, and keeps its place).

        Room `reserve`d under `key` is given back first, in the same step (no other task
        runs between), so the events it was reserved for are admitted into it.

        Returns:
            Per event, whether it was admitted.

        Raises:
            ValueError: `key` already holds events (our bug: the ledger lets one request
              with a key run at a time).
        """
        if key in self._held:
            raise ValueError("a request's events are already held")
        self._unreserve(key)
        share = self._shares.setdefault(credential_id, _Share())
        admitted: list[bool] = []
        held: list[_Item] = []
        for event in events:
            if event is None:
                admitted.append(False)
                continue
            size = frame_bytes(event)
            fits = self._fits(share, size)
            admitted.append(fits)
            if fits:
                held.append(_Item(credential_id, agent, event, size))
                share.bytes += size
                self._total += size
        self.counts.admitted += len(held)
        self.counts.refused += len(admitted) - len(held)
        self._held[key] = held
        if not share.bytes and not share.ready:
            self._shares.pop(credential_id, None)
        return tuple(admitted)

    def settle(self, key: HoldKey, *, keep: bool) -> None:
        """Release `key`'s held events to the pacer (`keep`), or drop them; give back any
        room still reserved under it. Idempotent."""
        self._unreserve(key)
        held = self._held.pop(key, None)
        if not held:
            return
        if not keep:
            for item in held:
                self._release(item)
            self.counts.dropped_unsettled += len(held)
            return
        credential_id = held[0].credential_id
        share = self._shares[credential_id]
        if not share.ready:
            self._turns.append(credential_id)
        share.ready.extend(held)
        self._wake.set()

    # ------------------------------------------------------------------ accounting

    @property
    def queued_bytes(self) -> int:
        """Bytes of every event held or waiting, all credentials together."""
        return self._total

    def queued_bytes_of(self, credential_id: str) -> int:
        """Bytes of one credential's events held or waiting (its share in use)."""
        share = self._shares.get(credential_id)
        return share.bytes if share is not None else 0

    def _release(self, item: _Item) -> None:
        share = self._shares[item.credential_id]
        share.bytes -= item.size
        self._total -= item.size
        if not share.bytes and not share.ready:
            del self._shares[item.credential_id]

    def _next(self, now: float = math.inf) -> _Item | None:
        """The next event in round-robin order over the credentials with events ready,
        passing over one whose next event's agent may not publish at `now` (`_Pace`)."""
        for _ in range(len(self._turns)):
            credential_id = self._turns.popleft()
            share = self._shares.get(credential_id)
            if share is None or not share.ready:
                continue
            if not self._pace.may_publish(share.ready[0].agent, now):
                self._turns.append(credential_id)  # its turn comes round again
                continue
            item = share.ready.popleft()
            if share.ready:
                self._turns.append(credential_id)
            return item
        return None

    # ------------------------------------------------------------------ the pacer

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Publish admitted events until cancelled; `started()` once `hold` may be used."""
        interval = 1.0 / self._config.publish_per_second
        in_flight = trio.CapacityLimiter(self._config.max_in_flight)
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                now = trio.current_time()
                item = self._next(now)
                if item is None:
                    # Woken by `settle`, by an OK that frees an agent, or when the next
                    # agent's spacing has passed.
                    self._wake = trio.Event()
                    with trio.move_on_at(self._pace.next_due(now)):
                        await self._wake.wait()
                    continue
                await in_flight.acquire_on_behalf_of(item)
                # Spaced from when it is handed over, after any wait for a slot.
                self._pace.published(item.agent, trio.current_time())
                nursery.start_soon(self._send, item, in_flight)
                await trio.sleep(interval)

    async def _send(self, item: _Item, in_flight: trio.CapacityLimiter) -> None:
        try:
            result = await self._publish(item.agent, item.event)
        except Exception as exc:  # noqa: BLE001 - one event lost, never the pacer
            self._lines.record("observer.publish_fault", item.agent, type(exc).__name__,
                               agent=item.agent, event_id=item.event.id,
                               error=type(exc).__name__)
            self.counts.failed += 1
        else:
            if isinstance(result, Accepted):
                self.counts.published += 1
            else:
                # The relay's reason is operator text; the event's content is ciphertext,
                # and is not logged either.
                outcome = type(result).__name__.lower()
                self._lines.record("observer.dropped", item.agent, outcome, agent=item.agent,
                                   event_id=item.event.id, result=outcome,
                                   reason=quote_reason(getattr(result, "reason", "")))
                self.counts.failed += 1
        finally:
            self._release(item)
            in_flight.release_on_behalf_of(item)
            self._pace.answered(item.agent)
            self._wake.set()


class _Pace:
    """Per agent: when its next event may go to the relay, and whether one awaits its OK.

    Holds only agents with an event in flight or handed over within the last interval
    (`next_due` forgets the others), so at most the agents publishing now."""

    def __init__(self, interval: float) -> None:
        self._interval = interval
        self._due: dict[str, float] = {}  # agent -> earliest time of its next event
        self._awaiting: set[str] = set()  # agents with an event awaiting its OK

    def may_publish(self, agent: str, now: float) -> bool:
        return agent not in self._awaiting and self._due.get(agent, -math.inf) <= now

    def published(self, agent: str, now: float) -> None:
        self._due[agent] = now + self._interval
        self._awaiting.add(agent)

    def answered(self, agent: str) -> None:
        self._awaiting.discard(agent)

    def next_due(self, now: float) -> float:
        """The earliest time a paced agent may publish again (inf: none is waiting for
        its spacing); forgets the agents whose spacing has passed."""
        for agent in [a for a, due in self._due.items() if due <= now]:
            del self._due[agent]
        return min(self._due.values(), default=math.inf)


@dataclass(frozen=True, slots=True)
class ObserverIntake:
    """What observer.emit is handed (`Context.observer`): the queue, the `seq` store and
    the wall clock its `timestamp`s are read from (injectable: tests fix the time).

    `hold_key`: what this request's frames are held under, set per request by the broker
    (its ledger ticket); the daemon's own intake has none."""

    queue: ObserverQueue
    seq: ObserverSeq
    clock: Callable[[], float]
    hold_key: HoldKey | None = None
