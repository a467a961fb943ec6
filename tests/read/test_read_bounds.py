"""What a misbehaving relay can cost one read, and what a window leaves behind when it ends.

Each test is one bound the read path keeps against a relay that does not behave as an
honest NIP-01 relay: a window that ends while it is being opened closes its subscription;
a created_at past what an event can hold is the relay's fault, never the daemon's; forged
events stop a read after a few signature checks; judging a large reply lets other tasks
run. Costs are asserted as counts (subscriptions, signature checks, loop turns), never as
time.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import trio

from buzzwire.contract import ChannelReadArgs, ErrorCode, Event, ReadOutcome, Status
from buzzwire.nostr import compute_event_id, verify_event
from daemon.operations import channel_read
from daemon.relay import paging
from daemon.relay.cursor import CursorCodec
from daemon.relay.paging import MAX_CREATED_AT, Page, read_page
from daemon.relay.pool import Accepted, RelayPool, RelayTimeouts
from daemon.relay.windows import Window, WindowCache, WindowKey
from tests.fixtures.relay import TestKey, auth_signer_for, signed
from tests.read._support import NOW, context, new_channel, principal_for
from tests.scripted_relay import Script, ScriptedRelay

TIMEOUTS = RelayTimeouts(connect=10, ok=10, eose=10, idle_seconds=60)


def _read_ctx(relay: Any, tmp_path: Path, agent: str, channel: str) -> Any:
    return context(relay, principal_for(tmp_path, agent, [channel]),
                   CursorCodec.open(str(tmp_path)))


# --- a window that ends while it is being opened ---------------------------------------


async def test_a_window_ended_by_too_many_stored_events_closes_its_subscription(
        scripted_relay: Callable[[Script], Awaitable[ScriptedRelay]], tmp_path: Path,
        nursery: trio.Nursery) -> None:
    # The scripted relay ignores `limit`: the window's live REQ gets every stored event
    # before EOSE, more than the window's depth, so the window ends inside `subscribe`.
    # Its subscription must still be closed: each such read leaked one, until the agent's
    # connection was full (no windows any more) and never idle.
    relay = await scripted_relay(Script())
    reader, author = TestKey(), TestKey()
    channel = new_channel()
    pool = RelayPool(relay.url, auth_signer_for(reader, author), timeouts=TIMEOUTS,
                     max_live_subscriptions=4)
    pool.windows = WindowCache(pool, depth=5, keep=5)
    await nursery.start(pool.run)
    for n in range(8):
        ev = author.sign(9, f"m{n}", [["h", channel]], NOW - n)
        assert isinstance(await pool.publish(author.pubkey, signed(ev)), Accepted)
    ctx = _read_ctx(pool, tmp_path, reader.pubkey, channel)
    for _ in range(6):  # past max_live_subscriptions
        verdict = await channel_read.execute(ctx, ChannelReadArgs(channel_id=channel, limit=5))
        assert verdict.status is Status.SUCCEEDED
        assert isinstance(verdict.outcome, ReadOutcome) and len(verdict.outcome.messages) == 5
        conn = pool._connections[reader.pubkey]
        assert (conn.live, conn.in_use, len(conn.subscriptions)) == (0, 0, 0)
    assert len(pool.windows) == 0
    assert sum(1 for m in relay.received if m[0] == "REQ") == 12, "every read tried a window"


class _Subscription:
    closed = 0

    def close(self) -> None:
        self.closed += 1


async def test_a_window_ended_by_a_deletion_before_subscribe_returns_closes_it() -> None:
    # A live deletion may arrive after EOSE but before `subscribe` returns (the reader task
    # runs first): the window ends with no subscription yet to close.
    subscription = _Subscription()
    channel = new_channel()

    class Pool:
        async def subscribe(self, agent: str, filters: object, sink: Window) -> _Subscription:
            sink.event({"kind": 5, "tags": [["h", channel], ["e", "0" * 64]]}, live=True)
            return subscription

    cache = WindowCache(Pool(), depth=10, keep=10)  # type: ignore[arg-type]
    page: Page[Event] = Page(items=(), next_position=None, rounds=1)

    async def read() -> Page[Event]:
        return page

    got, window = await cache.open(WindowKey("a" * 64, channel, False), [{"kinds": [9]}],
                                   Event.from_json_obj, read, max_page_bytes=1 << 20,
                                   size_of=lambda e: 1)
    assert got is page and window is None, "the plain read answers"
    assert subscription.closed == 1 and len(cache) == 0


def test_a_window_judges_at_most_depth_items_while_filling() -> None:
    # A relay that floods a window's opening (stored events past `limit`, or live ones
    # before the page is read) with forged events: each is a signature check that is
    # never cached, so every item counts towards the window's bound, kept or not.
    calls = 0

    def accept(item: Mapping[str, object]) -> Event | None:
        nonlocal calls
        calls += 1
        return None  # forged: dropped

    cache = WindowCache(None, depth=10, keep=10)  # type: ignore[arg-type]
    window = Window(cache, WindowKey("a" * 64, new_channel(), False), accept, 10, 1 << 20,
                    lambda e: 1, 10)
    item = {"kind": 9, "id": "0" * 64}
    for n in range(1000):
        window.event(item, live=n % 2 == 0)
    assert calls == 10 and not window.valid


# --- created_at past what an event holds ------------------------------------------------


class _FarFutureRelay:
    """Fills every limit with events dated `created_at` (unsigned: paging refuses them
    before any is judged)."""

    windows = None

    def __init__(self, created_at: int, channel: str) -> None:
        self.created_at, self.channel, self.calls = created_at, channel, 0
        self.ids = itertools.count(1)

    async def query(self, agent: str, filters: list[dict[str, Any]]) -> list[dict[str, Any]]:
        self.calls += 1
        return [{"id": "%064x" % next(self.ids), "pubkey": "b" * 64, "created_at": self.created_at,
                 "kind": 9, "tags": [["h", self.channel]], "content": "x", "sig": "c" * 128}
                for flt in filters for _ in range(flt["limit"])]


@pytest.mark.parametrize("created_at", [MAX_CREATED_AT + 1, 2**64 - 1, 2**70])
async def test_a_relay_dating_events_past_an_event_is_garbled_not_a_fault(
        created_at: int, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    channel = new_channel()
    relay = _FarFutureRelay(created_at, channel)
    caplog.set_level(logging.INFO, logger="buzz_broker.read")
    verdict = await channel_read.execute(_read_ctx(relay, tmp_path, "a" * 64, channel),
                                         ChannelReadArgs(channel_id=channel))
    assert verdict.status is Status.FAILED and verdict.code is ErrorCode.ACTION_FAILED
    assert verdict.message == "the relay answered with data that cannot be paged"
    assert relay.calls == 1
    garbled = [r for r in caplog.records if getattr(r, "buzz_event", None) == "read.relay_garbled"]
    assert len(garbled) == 1


async def test_paging_places_an_event_at_the_latest_created_at_an_event_holds() -> None:
    # The bound is the contract's (an Event's created_at): MAX_CREATED_AT itself pages.
    item = {"id": "1" * 64, "created_at": MAX_CREATED_AT, "kind": 9, "tags": []}

    async def query(filters: list[dict[str, object]]) -> list[dict[str, object]]:
        return [item] if "until" not in filters[-1] else []

    page = await read_page(query, [{"kinds": [9]}], after=None, limit=1, accept=lambda i: i)
    assert page.items == (item,) and page.malformed == 0


# --- forged events ----------------------------------------------------------------------


class _ForgingRelay:
    """Answers every query with `forged` well-formed events whose ids hash and signatures
    do not verify (never cached: each costs a check), then `good` real ones."""

    windows = None

    def __init__(self, channel: str, forged: int, good: list[dict[str, Any]]) -> None:
        pubkey = TestKey().pubkey
        times = itertools.count(NOW - 1000, -1)
        self.forged = []
        for _ in range(forged):
            t = next(times)
            self.forged.append({"id": compute_event_id(pubkey, t, 9, [["h", channel]], "x"),
                                "pubkey": pubkey, "created_at": t, "kind": 9,
                                "tags": [["h", channel]], "content": "x", "sig": "ab" * 64})
        self.good = good
        self.calls = 0

    async def query(self, agent: str, filters: list[dict[str, Any]]) -> list[dict[str, Any]]:
        self.calls += 1
        return [*self.good, *self.forged]


@pytest.fixture
def verifications(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts every id-and-signature check a read makes."""
    count = [0]
    real = verify_event

    def counted(item: Any) -> bool:
        count[0] += 1
        return real(item)

    monkeypatch.setattr(channel_read, "verify_event", counted)
    return count


async def test_a_relay_sending_forged_events_fails_the_read_after_a_few_checks(
        tmp_path: Path, verifications: list[int], caplog: pytest.LogCaptureFixture) -> None:
    # Before: 8 rounds of 5,000 forged events were 40,000 signature checks on the loop,
    # for one poll; now the read stops at the first check past the bound.
    channel = new_channel()
    relay = _ForgingRelay(channel, 5000, [])
    caplog.set_level(logging.INFO, logger="buzz_broker.read")
    verdict = await channel_read.execute(_read_ctx(relay, tmp_path, "a" * 64, channel),
                                         ChannelReadArgs(channel_id=channel))
    assert verdict.status is Status.FAILED and verdict.code is ErrorCode.ACTION_FAILED
    assert verdict.message == "the relay answered with events whose signatures do not verify"
    assert verifications[0] == channel_read.MAX_FORGED_EVENTS + 1
    assert relay.calls == 1
    garbled = [r for r in caplog.records if getattr(r, "buzz_event", None) == "read.relay_garbled"]
    assert [getattr(r, "buzz_fields", {}).get("reason") for r in garbled] == ["forged_events"]


async def test_a_few_forged_events_are_dropped_and_the_read_goes_on(
        tmp_path: Path, verifications: list[int]) -> None:
    # A relay holding a stray corrupt event still serves the channel's good ones.
    author, channel = TestKey(), new_channel()
    good = [author.sign(9, f"m{n}", [["h", channel]], NOW - n) for n in range(3)]
    relay = _ForgingRelay(channel, channel_read.MAX_FORGED_EVENTS, good)
    verdict = await channel_read.execute(_read_ctx(relay, tmp_path, "a" * 64, channel),
                                         ChannelReadArgs(channel_id=channel))
    assert verdict.status is Status.SUCCEEDED
    assert isinstance(verdict.outcome, ReadOutcome)
    assert [e.id for e in verdict.outcome.messages] == [e["id"] for e in good]
    assert verifications[0] == channel_read.MAX_FORGED_EVENTS + len(good)


# --- judging yields to the loop ---------------------------------------------------------


async def test_judging_a_large_reply_lets_other_tasks_run() -> None:
    # Valid events cost a signature check each too (those of another channel, judged and
    # then dropped): one reply of thousands must not hold the loop while it is judged.
    # A task that counts loop turns runs between any two checkpoints of the read, so
    # within any 2 x ACCEPTS_PER_CHECKPOINT consecutive judgements (trio may run the two
    # tasks of one scheduling batch in either order, so one checkpoint alone is not enough
    # to see a turn).
    turns = 0
    seen: list[int] = []

    async def ticker() -> None:
        nonlocal turns
        while True:
            await trio.sleep(0)
            turns += 1

    items = [{"id": "%064x" % n, "created_at": NOW - n, "kind": 9} for n in range(1, 2001)]

    async def query(filters: list[dict[str, object]]) -> list[dict[str, object]]:
        return items  # no await: only judging can let the ticker run

    def accept(item: Mapping[str, object]) -> None:
        seen.append(turns)
        return None  # every one dropped: the read judges them all

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await trio.sleep(0)
        # One reply (max_rounds 1): every event above its oldest second is judged.
        page: Page[None] = await read_page(query, [{"kinds": [9]}], after=None, limit=5,
                                           accept=accept, max_rounds=1)
        nursery.cancel_scope.cancel()
    assert page.items == ()
    step = paging.ACCEPTS_PER_CHECKPOINT
    assert len(seen) == len(items) - 1
    assert all(seen[i + 2 * step] > seen[i] for i in range(len(seen) - 2 * step))
