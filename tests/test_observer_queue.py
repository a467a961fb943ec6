"""The observer queue (daemon/pipeline/observer.py) and the seq store
(daemon/state/observer_seq.py), on their own: bounds, shares, hold/settle, fairness, and
seq numbers that never repeat across a restart.

The queue's relay is a recording function here: what is tested is the queue's own
accounting and order, which no relay can show (the relay-facing behaviour is
tests/e2e/test_observer.py's, on LocalRelay).
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from buzzwire.nostr import SignedEvent
from daemon.config import ObserverConfig
from daemon.pipeline.observer import ObserverQueue
from daemon.relay.pool import Accepted, PublishResult, Rejected, Unknown
from daemon.relay.protocol import encode_event
from daemon.state.observer_seq import BLOCK, ObserverSeq
from tests.fixtures.relay import TestKey, signed

AGENT = TestKey()


def event(content: str = "x" * 100) -> SignedEvent:
    return signed(AGENT.sign(24200, content, [["p", AGENT.pubkey]]))


SIZE = len(encode_event(event()).encode())


def config(*, total: int, share: int, rate: int = 1000, in_flight: int = 4,
           event_bytes: int = 65_536, per_agent: int = 60_000) -> ObserverConfig:
    return ObserverConfig(max_queued_bytes=total, max_queued_bytes_per_credential=share,
                          publish_per_second=rate, max_in_flight=in_flight,
                          max_event_bytes=event_bytes,
                          publish_per_minute_per_agent=per_agent)


class Relay:
    def __init__(self, answer: PublishResult = Accepted(duplicate=False, message=""),
                 silent: frozenset[str] = frozenset(), ok_timeout: float = 10.0) -> None:
        self.sent: list[tuple[str, str]] = []  # (agent, content)
        self.at: list[tuple[str, float]] = []  # (agent, trio time handed over)
        self.answer = answer
        #: agents whose frames get no OK (Buzz's rate-limit NOTICE): answered at the timeout
        self.silent, self.ok_timeout = silent, ok_timeout

    async def publish(self, agent: str, ev: SignedEvent) -> PublishResult:
        self.sent.append((agent, ev.content))
        self.at.append((agent, trio.current_time()))
        if agent in self.silent:
            await trio.sleep(self.ok_timeout)
            return Unknown(reason="no OK")
        return self.answer


def test_each_event_that_fits_its_share_is_admitted_and_the_rest_are_not() -> None:
    queue = ObserverQueue(config(total=100 * SIZE, share=3 * SIZE), Relay().publish)
    admitted = queue.hold(("a", "r1"), "cred-a", "a", [event()] * 5)
    assert admitted == (True, True, True, False, False)
    assert queue.queued_bytes_of("cred-a") == 3 * SIZE == queue.queued_bytes
    assert queue.room("cred-a") == 0
    # Another credential has its own share.
    assert queue.hold(("b", "r1"), "cred-b", "b", [event()] * 2) == (True, True)


def test_the_total_binds_across_credentials() -> None:
    queue = ObserverQueue(config(total=4 * SIZE, share=3 * SIZE), Relay().publish)
    assert sum(queue.hold(("a", "r"), "cred-a", "a", [event()] * 3)) == 3
    assert sum(queue.hold(("b", "r"), "cred-b", "b", [event()] * 3)) == 1
    assert queue.queued_bytes <= 4 * SIZE


def test_none_and_oversized_events_keep_their_place_and_are_not_admitted() -> None:
    queue = ObserverQueue(config(total=10**6, share=10**6, event_bytes=SIZE + 100),
                          Relay().publish)
    big = event("y" * 400)
    assert queue.hold(("a", "r"), "c", "a", [event(), None, big, event()]) == (
        True, False, False, True)


def test_a_held_batch_is_released_or_dropped_by_settle() -> None:
    queue = ObserverQueue(config(total=10**6, share=10**6), Relay().publish)
    queue.hold(("a", "r1"), "c", "a", [event()] * 2)
    queue.settle(("a", "r1"), keep=False)
    assert queue.queued_bytes == 0 and queue.counts.dropped_unsettled == 2
    assert queue._next() is None  # nothing for the pacer
    queue.settle(("a", "r1"), keep=True)  # idempotent: nothing left to settle
    assert queue._next() is None
    with pytest.raises(ValueError):
        queue.hold(("a", "r2"), "c", "a", [event()])
        queue.hold(("a", "r2"), "c", "a", [event()])


def test_holds_are_kept_apart_by_their_owner_not_their_request_id() -> None:
    """The broker holds a request's frames under its ledger ticket (compared by identity):
    two requests with one requestId (one out of its credential's scope, keyed apart by the
    ledger) hold apart, and settling one leaves the other's frames alone."""
    from daemon.state.ledger import LedgerKey, Ticket

    queue = ObserverQueue(config(total=10**6, share=10**6), Relay().publish)
    mine = Ticket(LedgerKey("a", "r"), b"\0" * 32)
    theirs = Ticket(LedgerKey("a/narrow", "r"), b"\1" * 32)
    queue.hold(mine, "wide", "a", [event("mine")])
    queue.hold(theirs, "narrow", "a", [event("theirs")])
    queue.settle(theirs, keep=False)
    assert queue.counts.dropped_unsettled == 1
    queue.settle(mine, keep=True)
    item = queue._next()
    assert item is not None and item.event.content == "mine" and queue._next() is None


def test_reserved_room_is_taken_from_the_share_until_held_or_settled() -> None:
    """observer.emit reserves each frame's room before custody makes the event: the
    reservation admits exactly what `hold` would, counts against the share meanwhile (a
    second request cannot spend the same room), `hold` fills it, `settle` gives back what
    no event took."""
    queue = ObserverQueue(config(total=100 * SIZE, share=3 * SIZE), Relay().publish)
    assert queue.reserve("r1", "c", [SIZE, None, SIZE, SIZE + 100_000, SIZE]) == (
        True, False, True, False, True)
    assert queue.queued_bytes_of("c") == 3 * SIZE and queue.room("c") == 0
    assert queue.reserve("r2", "c", [SIZE]) == (False,)  # the room is spoken for
    assert queue.hold("r2", "c", "a", [event()]) == (False,)
    # The reserved events are admitted into their room; what is left is given back.
    assert queue.hold("r1", "c", "a", [event(), None, event(), None, None]) == (
        True, False, True, False, False)
    assert queue.queued_bytes_of("c") == 2 * SIZE == queue.queued_bytes
    queue.settle("r1", keep=False)
    queue.settle("r2", keep=False)
    assert queue.queued_bytes == 0 and queue.room("c") == 3 * SIZE
    # A reservation never held (a fault between reserve and hold) is given back by settle.
    assert all(queue.reserve("r3", "c", [SIZE, SIZE]))
    queue.settle("r3", keep=True)
    assert queue.queued_bytes == 0 and queue._next() is None
    with pytest.raises(ValueError):
        queue.reserve("r4", "c", [SIZE])
        queue.reserve("r4", "c", [SIZE])


async def test_held_events_never_reach_the_relay_until_settled() -> None:
    relay = Relay()
    queue = ObserverQueue(config(total=10**6, share=10**6), relay.publish)
    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        queue.hold(("a", "r1"), "c", "a", [event("held")])
        await trio.testing.wait_all_tasks_blocked()
        assert relay.sent == []
        queue.settle(("a", "r1"), keep=True)
        while not relay.sent:
            await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert relay.sent == [("a", "held")]
    assert queue.queued_bytes == 0


def _ready(queue: ObserverQueue, agent: str, credential: str, events: list[Any]) -> None:
    """`events` of `agent` held under `credential` by one request, kept: ready to publish."""
    queue.hold((agent, "r"), credential, agent, events)
    queue.settle((agent, "r"), keep=True)

async def test_credentials_take_turns(autojump_clock: trio.testing.MockClock) -> None:
    relay = Relay()
    queue = ObserverQueue(config(total=10**6, share=10**6, rate=10, in_flight=1), relay.publish)
    _ready(queue, "a", "flood", [event(f"a{i}") for i in range(50)])
    _ready(queue, "b", "quiet", [event(f"b{i}") for i in range(2)])
    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        while len(relay.sent) < 6:
            await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    # The quiet credential's two events go out within the first rounds, not after 50.
    assert [c for _, c in relay.sent[:4]] == ["a0", "b0", "a1", "b1"]


async def test_one_agent_never_gets_more_than_its_rate_and_others_go_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Buzz counts kind 24200 frames against their author's own quotas (120 events a minute
    for an agent, 10 a second with its REQs): the pacer hands the relay one agent's frames
    no faster than `publish_per_minute_per_agent`, evenly spaced, whatever its backlog,
    and another agent's frames do not wait behind them."""
    relay = Relay()
    queue = ObserverQueue(config(total=10**6, share=10**6, rate=50, per_agent=30), relay.publish)
    _ready(queue, "a", "flood", [event(f"a{i}") for i in range(100)])
    _ready(queue, "b", "other", [event(f"b{i}") for i in range(3)])
    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        await trio.sleep(120)
        nursery.cancel_scope.cancel()
    a_times = [t for agent, t in relay.at if agent == "a"]
    assert 59 <= len(a_times) <= 61  # two minutes at 30 a minute, not 100 at once
    assert all(later - earlier >= 2.0 - 1e-9 for earlier, later in zip(a_times, a_times[1:]))
    for start in a_times:  # no 60 s window holds more than the rate (and its edge)
        assert sum(start <= t < start + 60 for t in a_times) <= 30
    # The other agent's three frames went out at its own pace, not after agent a's backlog.
    assert [t for agent, t in relay.at if agent == "b"][-1] <= 4.5


async def test_an_agent_without_oks_holds_at_most_one_slot(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """An agent over Buzz's quota gets a NOTICE and no OK, so its frame waits out the OK
    timeout: it keeps one of `max_in_flight` slots at most, and the others' frames go on."""
    relay = Relay(silent=frozenset({"a"}), ok_timeout=10.0)
    queue = ObserverQueue(config(total=10**6, share=10**6, rate=50, in_flight=2, per_agent=600),
                          relay.publish)
    _ready(queue, "a", "limited", [event(f"a{i}") for i in range(20)])
    _ready(queue, "b", "fine", [event(f"b{i}") for i in range(10)])
    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        await trio.sleep(5)
        nursery.cancel_scope.cancel()
    assert [c for agent, c in relay.sent if agent == "a"] == ["a0"]
    assert len([c for agent, c in relay.sent if agent == "b"]) == 10


async def test_a_refused_event_is_dropped_and_its_bytes_freed() -> None:
    relay = Relay(Rejected(reason="blocked: too many"))
    queue = ObserverQueue(config(total=10**6, share=10**6), relay.publish)
    _ready(queue, "a", "c", [event()])
    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        while not queue.counts.failed:
            await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert queue.queued_bytes == 0 and queue.counts.published == 0


async def test_a_relay_that_refuses_every_frame_costs_the_log_a_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # At the pacer's rate (50 a second by default, up to 10,000), a line per dropped
    # frame; now one a minute per agent and outcome, every frame still counted.
    caplog.set_level(logging.INFO, logger="buzz_broker.observer")
    relay = Relay(Rejected(reason="blocked: too many"))
    queue = ObserverQueue(config(total=10**6, share=10**6), relay.publish)
    _ready(queue, "a", "c", [event() for _ in range(30)])
    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        while queue.counts.failed < 30:
            await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    dropped = [r for r in caplog.records if r.getMessage() == "observer.dropped"]
    assert len(dropped) == 1 and len(relay.sent) == 30


# ------------------------------------------------------------------ seq numbers


async def test_seq_is_monotonic_across_requests_and_restarts(tmp_path: Path) -> None:
    store = ObserverSeq.open(tmp_path)
    first = await store.take("a", 3)
    second = await store.take("a", 2)
    other = await store.take("b", 1)
    assert list(first) == [1, 2, 3] and list(second) == [4, 5] and list(other) == [1]
    store.close()
    again = ObserverSeq.open(tmp_path)  # a restart: the reserved block is skipped
    after = await again.take("a", 1)
    assert after.start > second.stop - 1 and after.start <= second.stop + BLOCK
    more = await again.take("a", BLOCK + 5)  # past the block: a new ceiling is committed
    assert more.start == after.stop
    again.close()
    last = ObserverSeq.open(tmp_path)
    assert (await last.take("a", 1)).start >= more.stop
    last.close()


async def test_seq_numbers_are_committed_before_they_are_handed_out(tmp_path: Path) -> None:
    store = ObserverSeq.open(tmp_path)
    taken = await store.take("a", 10)
    # Read by another connection, as after a crash: the ceiling already covers them.
    row = sqlite3.connect(str(tmp_path / "observer_seq.db")).execute(
        "SELECT ceiling FROM observer_seq WHERE agent = 'a'").fetchone()
    assert row[0] >= taken.stop
    store.close()
