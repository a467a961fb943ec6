"""Read windows (daemon/relay/windows.py) against nostr-sdk's LocalRelay, NIP-42 AUTH on.

Each test states one promise a window must keep so that a cached poll is never less true
than a cold read: another client's post appears, a deletion or a removal takes events or
the window away, the relay's CLOSED drops it, one agent's window never answers another's
read, a revoked credential is refused with a warm window, the windows stay within
`read_window_bytes`, and a relay flooding a window being opened costs at most `depth`
judgements and a page's bytes before the window ends. No timing is asserted: a test that waits for the relay's live event
polls until it is seen, with a generous deadline only as the failure bound.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import AsyncIterator, Callable, Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from buzzwire.contract import (
    MAX_CONTENT_BYTES,
    MAX_ENCODED_EVENT_BYTES,
    ChannelReadArgs,
    ErrorCode,
    Event,
    ReadOutcome,
    Status,
    Verdict,
    encode_response,
)
from daemon.operations import channel_read
from daemon.operations._base import Context
from daemon.relay.cursor import CursorCodec, Position
from daemon.relay.paging import Page
from daemon.relay.pool import Accepted, AuthNotSigned, RelayPool, RelayTimeouts
from daemon.relay.windows import Window, WindowCache, WindowKey
from tests.fixtures.broker import BrokerHarness
from tests.fixtures.relay import TestKey, auth_signer_for, signed
from tests.read._support import NOW, context, new_channel, principal_for
from tests.scripted_relay import Script, ScriptedRelay

TIMEOUTS = RelayTimeouts(connect=10, ok=10, eose=10, idle_seconds=60)
#: Only a bound for a failing test: a live event normally arrives in milliseconds.
DEADLINE = 15.0
REQUEST_ID = "00000000-0000-4000-8000-000000000000"
#: Forged events a hostile relay sends one window in a test: far more log lines than any
#: bound would allow.
FLOOD = 500


@dataclass
class World:
    pool: RelayPool  # the daemon's pool: the readers' connections, with windows
    poster: RelayPool  # another client of the relay, its own connection
    reader: TestKey
    author: TestKey
    channel: str
    ctx: Context
    queries: Counter[str]
    tmp: Path

    async def post(self, content: str, *, at: int, kind: int = 9,
                   tags: list[list[str]] | None = None) -> dict[str, Any]:
        ev = self.author.sign(kind, content, tags if tags is not None else [["h", self.channel]], at)
        assert isinstance(await self.poster.publish(self.author.pubkey, signed(ev)), Accepted)
        return ev

    async def read(self, ctx: Context | None = None, **args: Any) -> Verdict:
        return await channel_read.execute(ctx or self.ctx, ChannelReadArgs(
            channel_id=args.pop("channel_id", self.channel), **args))


def _ids(verdict: Verdict) -> list[str]:
    assert verdict.status is Status.SUCCEEDED, verdict
    assert isinstance(verdict.outcome, ReadOutcome)
    return [e.id for e in verdict.outcome.messages]


async def _until(check: Callable[[], Awaitable[bool]]) -> None:
    """Wait for `check` to hold; DEADLINE bounds a failing test only."""
    with trio.fail_after(DEADLINE):
        while not await check():
            await trio.sleep(0.01)


def _pool(url: str, *keys: TestKey, queries: Counter[str] | None = None, **kw: Any) -> RelayPool:
    def observe(op: str, result: str, _seconds: float) -> None:
        if queries is not None:
            queries[op] += 1

    return RelayPool(url, auth_signer_for(*keys), timeouts=TIMEOUTS, observer=observe, **kw)


@pytest.fixture
async def world(local_relay: str, tmp_path: Path, nursery: trio.Nursery) -> AsyncIterator[World]:
    reader, author = TestKey(), TestKey()
    channel = new_channel()
    queries: Counter[str] = Counter()
    pool = _pool(local_relay, reader, queries=queries)
    pool.windows = WindowCache(pool, max_bytes=8 * 1024 * 1024)
    poster = _pool(local_relay, author)
    await nursery.start(pool.run)
    await nursery.start(poster.run)
    ctx = context(pool, principal_for(tmp_path, reader.pubkey, [channel]),
                  CursorCodec.open(str(tmp_path)), now=lambda: NOW)
    w = World(pool, poster, reader, author, channel, ctx, queries, tmp_path)
    for n in range(5):
        await w.post(f"message {n}", at=NOW - 100 + n)
    yield w


async def test_a_repeated_poll_is_answered_from_the_window_as_a_cold_read_would(world: World,
                                                                               local_relay: str,
                                                                               nursery: trio.Nursery
                                                                               ) -> None:
    first = await world.read(limit=3)
    reads = world.queries["query"]
    again = await world.read(limit=3)
    assert world.queries["query"] == reads, "a warm poll must not query the relay"
    assert _ids(again) == _ids(first)
    # The same page, cursor and bytes as a pool without windows reads from the same relay.
    plain = _pool(local_relay, world.reader)
    await nursery.start(plain.run)
    cold = await world.read(context(plain, world.ctx.principal, world.ctx.cursors), limit=3)
    assert encode_response(REQUEST_ID, again) == encode_response(REQUEST_ID, cold)
    # The encoded outcome the window supplies is the outcome's canonical form exactly.
    assert again.encoded_outcome is not None
    unencoded = Verdict.succeeded(channel_read.ACTION, again.outcome)  # type: ignore[arg-type]
    assert encode_response(REQUEST_ID, again) == encode_response(REQUEST_ID, unencoded)
    assert _ids(await world.read(limit=100)) == _ids(
        await world.read(context(plain, world.ctx.principal, world.ctx.cursors), limit=100))


async def test_another_clients_post_appears_in_the_next_poll(world: World) -> None:
    before = _ids(await world.read())
    reads = world.queries["query"]
    new = await world.post("from another client", at=NOW)

    async def seen() -> bool:
        return _ids(await world.read())[:1] == [new["id"]]

    await _until(seen)
    # It came by the live subscription, not by a new relay query.
    assert world.queries["query"] == reads
    assert _ids(await world.read()) == [new["id"], *before]


async def test_a_deletion_takes_the_event_away(world: World) -> None:
    before = _ids(await world.read())
    assert len(world.pool.windows or ()) == 1
    victim = before[0]
    await world.post("", at=NOW, kind=5, tags=[["e", victim], ["h", world.channel]])

    async def gone() -> bool:
        return victim not in _ids(await world.read())

    await _until(gone)
    assert _ids(await world.read()) == before[1:]


async def test_a_nip29_removal_of_the_agent_drops_its_window(world: World) -> None:
    await world.read()
    key = WindowKey(world.reader.pubkey, world.channel, False)
    assert world.pool.windows is not None and world.pool.windows.get(key) is not None
    await world.post("", at=NOW, kind=9001, tags=[["h", world.channel], ["p", world.reader.pubkey]])
    windows = world.pool.windows

    async def dropped() -> bool:
        return windows.get(key) is None

    await _until(dropped)
    reads = world.queries["query"]
    await world.read()  # cold again: the relay decides what the agent may still see
    assert world.queries["query"] > reads


@dataclass
class ScriptedWorld:
    """A pool with windows on the scripted relay, one event posted, its window open."""

    relay: ScriptedRelay
    pool: RelayPool
    author: TestKey
    channel: str
    ctx: Context
    first: dict[str, Any]
    queries: Counter[str]

    async def read(self) -> Verdict:
        return await channel_read.execute(self.ctx, ChannelReadArgs(channel_id=self.channel))


async def _scripted_window(scripted_relay: Callable[[Script], Awaitable[ScriptedRelay]],
                           tmp_path: Path, nursery: trio.Nursery) -> ScriptedWorld:
    relay = await scripted_relay(Script(challenge_at_connect=True, require_auth=True))
    reader, author = TestKey(), TestKey()
    channel = new_channel()
    queries: Counter[str] = Counter()
    pool = _pool(relay.url, reader, author, queries=queries)
    pool.windows = WindowCache(pool)
    await nursery.start(pool.run)
    ev = author.sign(9, "hello", [["h", channel]], NOW - 50)
    assert isinstance(await pool.publish(author.pubkey, signed(ev)), Accepted)
    ctx = context(pool, principal_for(tmp_path, reader.pubkey, [channel]), CursorCodec.open(str(tmp_path)))
    w = ScriptedWorld(relay, pool, author, channel, ctx, ev, queries)
    assert _ids(await w.read()) == [ev["id"]]
    assert len(pool.windows) == 1
    return w


async def test_relay_closed_drops_the_window(scripted_relay: Callable[[Script], Awaitable[ScriptedRelay]],
                                             tmp_path: Path, nursery: trio.Nursery) -> None:
    w = await _scripted_window(scripted_relay, tmp_path, nursery)
    # The relay ends the live subscription (and, harmlessly, any REQ whose CLOSE it has not
    # read yet).
    assert await w.relay.close_open_reqs() >= 1
    windows = w.pool.windows

    async def dropped() -> bool:
        return len(windows) == 0

    await _until(dropped)
    reads = w.queries["query"]
    assert _ids(await w.read()) == [w.first["id"]]
    assert w.queries["query"] > reads, "after CLOSED the read goes to the relay again"


async def test_one_agents_window_never_answers_another(world: World, local_relay: str,
                                                       nursery: trio.Nursery) -> None:
    """Agent B is refused by the relay (its AUTH cannot be made); agent A's warm window of
    the same channel must not answer B."""
    outsider = TestKey()
    signer = auth_signer_for(world.reader)

    async def sign(agent: str, url: str, challenge: str, created_at: int) -> Any:
        if agent == outsider.pubkey:
            raise AuthNotSigned("not this agent")
        return await signer(agent, url, challenge, created_at)

    pool = RelayPool(local_relay, sign, timeouts=TIMEOUTS)
    pool.windows = WindowCache(pool)
    await nursery.start(pool.run)
    ctx_a = context(pool, world.ctx.principal, world.ctx.cursors)
    assert len(_ids(await world.read(ctx_a))) == 5
    ctx_b = context(pool, principal_for(world.tmp, outsider.pubkey, [world.channel]),
                    world.ctx.cursors)
    refused = await world.read(ctx_b)
    assert refused.status is Status.FAILED and refused.code is ErrorCode.ACTION_FAILED
    assert len(pool.windows) == 1  # A's, still warm
    assert len(_ids(await world.read(ctx_a))) == 5


async def test_windows_stay_within_read_window_bytes(local_relay: str, tmp_path: Path,
                                                     nursery: trio.Nursery) -> None:
    reader, author = TestKey(), TestKey()
    channels = [new_channel() for _ in range(6)]
    pool = _pool(local_relay, reader, author)
    await nursery.start(pool.run)
    for channel in channels:
        for n in range(20):
            ev = author.sign(9, "x" * 1000, [["h", channel]], NOW - 50 + n)
            assert isinstance(await pool.publish(author.pubkey, signed(ev)), Accepted)
    windows = WindowCache(pool, max_bytes=0)
    pool.windows = windows
    ctx = context(pool, principal_for(tmp_path, reader.pubkey, channels), CursorCodec.open(str(tmp_path)))
    await channel_read.execute(ctx, ChannelReadArgs(channel_id=channels[0]))
    one = windows.bytes  # max_bytes 0 keeps nothing
    assert one == 0 and len(windows) == 0
    probe = WindowCache(pool)
    pool.windows = probe
    await channel_read.execute(ctx, ChannelReadArgs(channel_id=channels[0]))
    size = probe.bytes
    assert size > 20 * 1000
    probe.close()
    bound = int(size * 2.5)  # room for two windows of this size, not three
    windows = WindowCache(pool, max_bytes=bound)
    pool.windows = windows
    for channel in channels:
        verdict = await channel_read.execute(ctx, ChannelReadArgs(channel_id=channel))
        assert len(_ids(verdict)) == 20
        assert windows.bytes <= bound
    assert len(windows) == 2
    conn = pool._connections[reader.pubkey]
    assert conn.live == 2, "an evicted window's subscription is closed"
    # The most recently used are kept.
    kept = [c for c in channels if windows.get(WindowKey(reader.pubkey, c, False)) is not None]
    assert kept == channels[-2:]


async def test_past_the_subscription_cap_reads_are_plain_queries(world: World, local_relay: str,
                                                                 nursery: trio.Nursery) -> None:
    channels = [new_channel() for _ in range(3)]
    for channel in channels:
        await world.post("hi", at=NOW - 1, tags=[["h", channel]])
    queries: Counter[str] = Counter()
    pool = _pool(local_relay, world.reader, queries=queries, max_live_subscriptions=2)
    pool.windows = WindowCache(pool)
    await nursery.start(pool.run)
    ctx = context(pool, principal_for(world.tmp, world.reader.pubkey, channels), world.ctx.cursors)
    for channel in channels:
        assert len(_ids(await world.read(ctx, channel_id=channel))) == 1
    assert len(pool.windows) == 2
    reads = queries["query"]
    assert len(_ids(await world.read(ctx, channel_id=channels[2]))) == 1
    assert queries["query"] == reads + 1, "the third channel is read from the relay each time"


async def test_subscriptions_opened_together_stay_within_the_cap(world: World, local_relay: str,
                                                                 nursery: trio.Nursery) -> None:
    """An agent's polls of its channels arrive together (one per channel each tick), so
    their windows' subscriptions open together: each is counted from the cap's check, not
    from its EOSE, or all of them passed the check before any was counted."""
    from daemon.relay.pool import SubscriptionsFull

    class Sink:
        def event(self, item: dict[str, object], *, live: bool) -> None:
            pass

        def ended(self, reason: str) -> None:
            pass

    pool = _pool(local_relay, world.reader, max_live_subscriptions=2)
    await nursery.start(pool.run)
    outcomes: list[object] = []

    async def open_one(channel: str) -> None:
        try:
            outcomes.append(await pool.subscribe(
                world.reader.pubkey, [{"kinds": [9], "#h": [channel], "limit": 1}], Sink()))
        except SubscriptionsFull as exc:
            outcomes.append(exc)

    await pool.query(world.reader.pubkey, [{"kinds": [9], "limit": 1}])  # connected, authed
    async with trio.open_nursery() as together:
        for _ in range(6):
            together.start_soon(open_one, new_channel())
    opened = [o for o in outcomes if not isinstance(o, SubscriptionsFull)]
    assert len(opened) == 2 and len(outcomes) == 6, outcomes
    for subscription in opened:
        subscription.close()  # type: ignore[attr-defined]
    assert pool._connections[world.reader.pubkey].live == 0


async def test_revoked_credential_is_refused_with_a_warm_window(broker: BrokerHarness) -> None:
    agent = await broker.human_owned_agent()
    channel = new_channel()
    credential_id, token = broker._sessions.issue(
        agent=agent, channels=frozenset({channel}), actions=frozenset({"channel.read", "message.post"}),
        ttl_seconds=None, uid=None, now=NOW)
    posted = await broker.call(token, "message.post", {"channelId": channel, "content": "hello"})
    assert posted["status"] == "succeeded", posted
    for _ in range(2):  # the second poll is answered from the window
        answer = await broker.call(token, "channel.read", {"channelId": channel, "limit": 100})
        assert answer["status"] == "succeeded" and len(answer["outcome"]["messages"]) == 1
    windows = broker.app._relay.windows
    assert windows is not None and len(windows) == 1
    assert broker._sessions.revoke(credential_id)
    status, envelope = await broker.post(
        json.dumps({"type": "broker_request", "protocolVersion": 1,
                    "requestId": "11111111-1111-4111-8111-111111111111", "actionVersion": 1,
                    "action": "channel.read", "args": {"channelId": channel, "limit": 100}}).encode(),
        token)
    assert envelope is not None and envelope["status"] == "failed", envelope
    assert envelope["error"]["code"] == "unauthenticated"
    assert "outcome" not in envelope


# --- continuations, shared events, shared judging (issue 24: the fleet at full size) -------


def _cursor(verdict: Verdict) -> str | None:
    assert isinstance(verdict.outcome, ReadOutcome)
    return verdict.outcome.next_cursor


async def test_a_cursor_continuation_is_kept_and_answered_from_the_window(
        world: World, local_relay: str, nursery: trio.Nursery) -> None:
    """Buzz's runtime follows nextCursor back through a channel before it reads the
    default window again: the page after the window's bottom is kept by the window, and
    the next time that continuation is read it is answered as a cold read would be."""
    for n in range(5, 8):
        await world.post(f"message {n}", at=NOW - 100 + n)  # 8 events in all
    pool = _pool(local_relay, world.reader, queries=(queries := Counter[str]()))
    pool.windows = WindowCache(pool, depth=3, keep=10)
    await nursery.start(pool.run)
    ctx = context(pool, world.ctx.principal, world.ctx.cursors)
    plain = _pool(local_relay, world.reader)
    await nursery.start(plain.run)
    cold_ctx = context(plain, world.ctx.principal, world.ctx.cursors)

    first = await world.read(ctx, limit=3)
    one = _cursor(first)
    assert one is not None and len(_ids(first)) == 3
    reads = queries["query"]
    second = await world.read(ctx, limit=3, cursor=one)  # below the window: read, and kept
    assert queries["query"] == reads + 1
    two = _cursor(second)
    assert two is not None
    third = await world.read(ctx, limit=3, cursor=two)  # the end of the channel, kept too
    assert _cursor(third) is None and len(_ids(third)) == 2
    reads = queries["query"]
    for cursor in (None, one, two):
        warm = await world.read(ctx, limit=3, cursor=cursor)
        cold = await world.read(cold_ctx, limit=3, cursor=cursor)
        assert encode_response(REQUEST_ID, warm) == encode_response(REQUEST_ID, cold)
    assert queries["query"] == reads, "every page of the channel came from the window"
    # A page of another limit inside the window is the cold read's too.
    warm = await world.read(ctx, limit=2, cursor=one)
    assert encode_response(REQUEST_ID, warm) == encode_response(
        REQUEST_ID, await world.read(cold_ctx, limit=2, cursor=one))
    assert queries["query"] == reads


async def test_a_post_reaches_a_window_holding_continuation_pages(world: World,
                                                                 nursery: trio.Nursery,
                                                                 local_relay: str) -> None:
    pool = _pool(local_relay, world.reader, queries=(queries := Counter[str]()))
    pool.windows = WindowCache(pool, depth=2, keep=10)
    await nursery.start(pool.run)
    ctx = context(pool, world.ctx.principal, world.ctx.cursors)
    first = await world.read(ctx, limit=2)
    await world.read(ctx, limit=2, cursor=_cursor(first))  # the window now holds 4
    new = await world.post("from another client", at=NOW)

    async def seen() -> bool:
        return _ids(await world.read(ctx, limit=2))[:1] == [new["id"]]

    await _until(seen)
    reads = queries["query"]
    # The new event pushed the old first page down by one: the page after the new first
    # page's cursor is still in the window, and the same as the relay's.
    page = await world.read(ctx, limit=2)
    after = await world.read(ctx, limit=2, cursor=_cursor(page))
    assert queries["query"] == reads
    plain = _pool(local_relay, world.reader)
    await nursery.start(plain.run)
    cold = await world.read(context(plain, world.ctx.principal, world.ctx.cursors), limit=2,
                            cursor=_cursor(page))
    assert _ids(after) == _ids(cold)


def test_a_live_event_below_the_bottom_keeps_a_continuation_out() -> None:
    """A continuation read in flight may or may not have seen an event that arrives live
    below the window's bottom meanwhile: that page is then not kept."""
    from daemon.relay.cursor import Position
    from daemon.relay.paging import Page

    from buzzwire.contract import Event

    author, channel = TestKey(), new_channel()
    events = [Event.from_json_obj(author.sign(9, f"m{n}", [["h", channel]], NOW - n))
              for n in range(6)]  # newest first
    cache = WindowCache(None, depth=2, keep=10)  # type: ignore[arg-type]
    from daemon.relay.windows import Window

    def accept(item: Any) -> Event | None:
        return Event.from_json_obj(item)

    window = Window(cache, WindowKey("a" * 64, channel, False), accept, 2, 1 << 20,
                    lambda e: 1, 10)
    bottom = Position(created_at=events[1].created_at, event_id=events[1].id)
    assert window.fill(Page(items=tuple(events[:2]), next_position=bottom, rounds=1))
    mark = window.continuation(bottom)
    assert mark is not None
    # events[4] arrives live (below the bottom) while the continuation is read.
    window.event(events[4].to_json_obj(), live=True)
    window.extend(mark, Page(items=tuple(events[2:4]), next_position=None, rounds=1))
    assert window.serve(2, bottom) is None, "the page read meanwhile was not kept"
    # Without such an arrival the same continuation is kept.
    mark = window.continuation(bottom)
    assert mark is not None
    window.extend(mark, Page(items=tuple(events[2:4]),
                             next_position=Position(created_at=events[3].created_at,
                                                    event_id=events[3].id), rounds=1))
    served = window.serve(2, bottom)
    assert served is not None and [e.id for e in served.messages] == [e.id for e in events[2:4]]
    window.end("test")
    assert cache.bytes == 0, "an ended window's events are released"


def _bare_window(cache: WindowCache, events: list[Any], *, keep: int = 10,
                 max_page_bytes: int = 1 << 20) -> Any:
    """A Window of `cache` filled with `events` (newest first), more below; no relay."""
    from daemon.relay.cursor import Position
    from daemon.relay.paging import Page
    from daemon.relay.windows import Window

    from buzzwire.contract import Event

    window = Window(cache, WindowKey(TestKey().pubkey, new_channel(), False),
                    Event.from_json_obj, len(events), max_page_bytes, lambda e: 1, keep)
    last = events[-1]
    bottom = Position(created_at=last.created_at, event_id=last.id)
    assert window.fill(Page(items=tuple(events), next_position=bottom, rounds=1))
    return window, bottom


def _events(count: int, content: str = "m", channel: str | None = None) -> list[Any]:
    from buzzwire.contract import Event

    author, channel = TestKey(), channel or new_channel()
    return [Event.from_json_obj(author.sign(9, f"{content}{n}", [["h", channel]], NOW - n))
            for n in range(count)]  # newest first


def test_a_live_deletion_below_the_bottom_keeps_a_continuation_out() -> None:
    """A deletion naming an event below the window's bottom, arriving live while a
    continuation read is in flight, may postdate the relay's answer to that read: the page
    read meanwhile is not kept, or the window would serve the deleted event to every later
    cursor read (the relay's deletion was delivered, and it names no event the window
    held, so it ended nothing)."""
    from daemon.relay.paging import Page

    events = _events(6)
    cache = WindowCache(None, depth=2, keep=10)  # type: ignore[arg-type]
    window, bottom = _bare_window(cache, events[:2])
    mark = window.continuation(bottom)
    assert mark is not None
    deletion = TestKey().sign(5, "", [["e", events[3].id], ["h", window.key.channel_id]], NOW)
    window.event(deletion, live=True)
    assert window.valid, "it named no event of the window"
    window.extend(mark, Page(items=tuple(events[2:4]), next_position=None, rounds=1))
    assert window.serve(2, bottom) is None, "the page read meanwhile was not kept"


async def test_a_kept_page_is_counted_and_only_one_is_kept() -> None:
    """The default page a window keeps between polls is a copy of its events' bytes: it
    is counted in read_window_bytes, and one is kept (the last limit served), so an agent
    cycling `limit` costs CPU, not a page per limit."""
    events = _events(50, "x" * 2000)
    cache = WindowCache(None, depth=50, keep=50)  # type: ignore[arg-type]
    window, _ = _bare_window(cache, events, keep=50)
    cache._keep(window)
    unserved = cache.bytes
    first = window.serve(50)
    assert first is not None and window.serve(50) is first, "an unchanged window's page is kept"
    one_page = cache.bytes - unserved
    assert one_page >= len(first.encoded_messages)
    for limit in range(1, 51):
        assert window.serve(limit) is not None
    assert cache.bytes <= unserved + one_page, "pages of other limits were not kept beside it"
    window.end("test")
    assert cache.bytes == 0, "an ended window's page is released"


async def test_a_window_too_large_alone_evicts_no_other() -> None:
    """A window that could never fit read_window_bytes goes by itself: ending every other
    agent's window first, as plain least-recently-used eviction did, would leave nothing
    kept, at each poll of the one agent reading a channel of large events."""
    cache = WindowCache(None, depth=5, keep=5, max_bytes=1 << 20)  # type: ignore[arg-type]
    small = [_bare_window(cache, _events(3), keep=5)[0] for _ in range(4)]
    for window in small:
        cache._keep(window)
    assert len(cache) == 4 and cache.bytes < cache.max_bytes
    big, _ = _bare_window(cache, _events(5, "y" * 200_000), keep=5)
    cache._keep(big)
    assert not big.valid and len(cache) == 4 and all(w.valid for w in small)
    cache.close()
    assert cache.bytes == 0


def test_the_judged_cache_counts_at_least_what_its_entries_hold() -> None:
    """`JudgedCache` is bounded by the bytes its entries hold, not by their JSON: an event
    of many short tags is small on the wire and large as objects, and a relay may send as
    many such events as it likes (they are remembered before the channel check)."""
    import gc
    import tracemalloc

    from daemon.operations.channel_read import JudgedCache

    from buzzwire.contract import Event

    author = TestKey()
    events = [Event.from_json_obj(author.sign(9, str(n), [["a"]] * 4000, NOW - n))
              for n in range(12)]
    cache = JudgedCache(8 * 1024 * 1024)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for event in events:
            cache.remember(event)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert 0 < held <= cache._bytes <= 8 * 1024 * 1024, (held, cache._bytes)


async def test_windows_of_one_channel_hold_each_event_once(local_relay: str, tmp_path: Path,
                                                           nursery: trio.Nursery) -> None:
    """Each agent keeps its own window (its own AUTH), but an event two windows hold is
    counted in read_window_bytes once."""
    one, two, author = TestKey(), TestKey(), TestKey()
    channel = new_channel()
    pool = _pool(local_relay, one, two, author)
    await nursery.start(pool.run)
    for n in range(20):
        ev = author.sign(9, "x" * 1000, [["h", channel]], NOW - 50 + n)
        assert isinstance(await pool.publish(author.pubkey, signed(ev)), Accepted)
    windows = WindowCache(pool)
    pool.windows = windows
    cursors = CursorCodec.open(str(tmp_path))
    first = await channel_read.execute(
        context(pool, principal_for(tmp_path / "1", one.pubkey, [channel]), cursors),
        ChannelReadArgs(channel_id=channel))
    alone = windows.bytes
    second = await channel_read.execute(
        context(pool, principal_for(tmp_path / "2", two.pubkey, [channel]), cursors),
        ChannelReadArgs(channel_id=channel))
    assert len(windows) == 2 and _ids(first) == _ids(second)
    # Besides its references, each window keeps its own default page's bytes between polls.
    kept = windows.get(WindowKey(two.pubkey, channel, False))
    assert kept is not None and kept._page_cache is not None
    page = len(kept._page_cache[1].encoded_messages)
    assert windows.bytes - alone - page < alone / 4, "the second window holds references only"
    windows.close()
    assert windows.bytes == 0


async def test_a_due_window_is_confirmed_by_the_newest_page_and_keeps_its_continuations(
        world: World, local_relay: str, nursery: trio.Nursery) -> None:
    """Once max_age old, a window answers again only after the relay's newest page, read
    afresh under the agent's AUTH, is found to be its own first page; then the pages it
    holds below stay (a fleet's refresh is one read per window, not one per page)."""
    pool = _pool(local_relay, world.reader, queries=(queries := Counter[str]()))
    windows = WindowCache(pool, depth=2, keep=10, max_age=0.2)
    pool.windows = windows
    await nursery.start(pool.run)
    ctx = context(pool, world.ctx.principal, world.ctx.cursors)
    first = await world.read(ctx, limit=2)
    second = await world.read(ctx, limit=2, cursor=_cursor(first))  # kept: the window holds 4
    await trio.sleep(0.25)  # due
    reads = queries["query"]
    again = await world.read(ctx, limit=2)
    assert queries["query"] == reads + 1, "one read of the newest page confirms the window"
    assert _ids(again) == _ids(first)
    assert _ids(await world.read(ctx, limit=2, cursor=_cursor(first))) == _ids(second)
    assert queries["query"] == reads + 1, "the continuation page stayed in the window"


def test_a_window_is_confirmed_only_by_its_own_first_page() -> None:
    from daemon.relay.cursor import Position
    from daemon.relay.paging import Page
    from daemon.relay.windows import Window

    from buzzwire.contract import Event

    author, channel = TestKey(), new_channel()
    events = [Event.from_json_obj(author.sign(9, f"m{n}", [["h", channel]], NOW - n))
              for n in range(4)]
    cache = WindowCache(None, depth=2, keep=10)  # type: ignore[arg-type]
    window = Window(cache, WindowKey("a" * 64, channel, False), Event.from_json_obj, 2,
                    1 << 20, lambda e: 1, 10)

    def page(items: list[Event], more: bool) -> Page[Event]:
        last = items[-1] if items else None
        return Page(items=tuple(items), rounds=1, next_position=(
            Position(created_at=last.created_at, event_id=last.id) if more and last else None))

    assert window.fill(page(events[:2], True))
    assert window.confirms(page(events[:2], True))
    # What a relay that dropped the agent silently answers: nothing (or less).
    assert not window.confirms(page([], False))
    assert not window.confirms(page(events[:1], False))
    # Another newest event than the window's own.
    assert not window.confirms(page([events[1], events[2]], True))
    assert not window.confirms(page(events[:2], False)), "the relay says nothing is below"
    window.end("test")


def test_a_check_that_finds_newer_events_places_them() -> None:
    """Posts published while the check is read reach it before their live copy: the
    relay's answer places them, and the window stays."""
    from daemon.relay.cursor import Position
    from daemon.relay.paging import Page
    from daemon.relay.windows import Window

    from buzzwire.contract import Event

    author, channel = TestKey(), new_channel()
    events = [Event.from_json_obj(author.sign(9, f"m{n}", [["h", channel]], NOW - n))
              for n in range(4)]
    cache = WindowCache(None, depth=3, keep=10)  # type: ignore[arg-type]
    window = Window(cache, WindowKey("a" * 64, channel, False), Event.from_json_obj, 3,
                    1 << 20, lambda e: 1, 10)
    assert window.fill(Page(items=tuple(events[1:]), next_position=None, rounds=1))
    check = Page(items=tuple(events[:3]), rounds=1,
                 next_position=Position(created_at=events[2].created_at, event_id=events[2].id))
    assert window.confirms(check)
    served = window.serve(3)
    assert served is not None and [e.id for e in served.messages] == [e.id for e in events[:3]]
    # An older event the window lacks is not "in flight": the window is not confirmed.
    other = Event.from_json_obj(author.sign(9, "unseen", [["h", channel]], NOW - 2))
    assert not window.confirms(Page(items=(events[0], other), rounds=1, next_position=None))
    window.end("test")


def test_a_check_leaves_out_what_arrived_live_while_it_was_read() -> None:
    """An event delivered live while the check is read may be missing from the relay's
    answer (it was read first): it does not make the window mismatch."""
    from daemon.relay.cursor import Position
    from daemon.relay.paging import Page
    from daemon.relay.windows import Window

    from buzzwire.contract import Event

    author, channel = TestKey(), new_channel()
    events = [Event.from_json_obj(author.sign(9, f"m{n}", [["h", channel]], NOW - n))
              for n in range(4)]
    cache = WindowCache(None, depth=3, keep=10)  # type: ignore[arg-type]
    window = Window(cache, WindowKey("a" * 64, channel, False), Event.from_json_obj, 3,
                    1 << 20, lambda e: 1, 10)
    assert window.fill(Page(items=tuple(events[1:]), next_position=None, rounds=1))
    window.begin_check()
    window.event(events[0].to_json_obj(), live=True)  # arrives during the check's read
    answer = Page(items=tuple(events[1:3]), rounds=1,
                  next_position=Position(created_at=events[2].created_at, event_id=events[2].id))
    assert window.confirms(answer)
    # Without the live arrival noted, the same answer lacks the window's newest event.
    assert not window.confirms(answer)
    window.end("test")


async def test_a_window_cuts_every_page_where_a_cold_read_cuts_it() -> None:
    """Served from a window, any page (the newest, or after any cursor position, with any
    limit and any byte bound) is the page paging reads from the relay: the same events,
    the same end, the same continuation position, and the events' canonical bytes."""
    from daemon.relay.cursor import Position
    from daemon.relay.paging import read_page
    from daemon.relay.windows import Window

    from buzzwire.contract import Event
    from tests.read.fake_relay import FakeRelay

    author, channel = TestKey(), new_channel()
    # Sizes that differ per event, several per second, so byte cuts fall anywhere.
    items = [author.sign(9, "x" * (37 * n % 500), [["h", channel]], NOW - n // 3)
             for n in range(40)]
    relay = FakeRelay(items, cap=500, seed=3)
    bases: list[dict[str, object]] = [{"kinds": [9], "#h": [channel]}]

    def size(event: Event) -> int:
        return 300 + len(event.content)

    async def cold(limit: int, after: Position | None, max_bytes: int) -> Any:
        return await read_page(relay.query, bases, after=after, limit=limit,
                               accept=Event.from_json_obj, max_bytes=max_bytes, size_of=size)

    everything = await cold(100, None, 1 << 30)
    positions: list[Position | None] = [None] + [
        Position(created_at=e.created_at, event_id=e.id) for e in everything.items[:-1]]
    for max_bytes in (1, 700, 2000, 5000, 1 << 20):
        cache = WindowCache(None, depth=100, keep=100)  # type: ignore[arg-type]
        window = Window(cache, WindowKey("a" * 64, channel, False), Event.from_json_obj, 100,
                        max_bytes, size, 100)
        assert window.fill(everything)
        for limit in (1, 3, 7, 100):
            for after in positions:
                served = window.serve(limit, after)
                page = await cold(limit, after, max_bytes)
                assert served is not None
                assert [e.id for e in served.messages] == [e.id for e in page.items]
                assert served.next_position == page.next_position, (max_bytes, limit, after)
                assert served.encoded_messages == b'{"messages":' + json.dumps(
                    [e.to_json_obj() for e in page.items], separators=(",", ":"),
                    ensure_ascii=False).encode()
        # The newest page again, from what `serve` kept: the same answer.
        assert window.serve(3) == window.serve(3)
        window.end("test")


async def test_a_hostile_relay_cannot_put_bad_events_in_a_window_nor_flood_the_log(
        scripted_relay: Callable[[Script], Awaitable[ScriptedRelay]], tmp_path: Path,
        nursery: trio.Nursery, caplog: pytest.LogCaptureFixture) -> None:
    # On the window's live subscription the relay sends forged events (ids that do not
    # hash, so no signature holds), a valid event of another channel, a valid one off
    # the read's filter (kind 1), and valid ones too large for Buzz's SDK (content past
    # 64 KiB, JSON past 512 KiB: it would refuse every poll's whole page): none reaches a
    # poll; the one good event does. Each drop was a warning line, as many as the relay
    # cared to send.
    w = await _scripted_window(scripted_relay, tmp_path, nursery)
    relay, author, channel = w.relay, w.author, w.channel
    caplog.set_level(logging.INFO, logger="buzz_broker.read")
    template = author.sign(9, "forged", [["h", channel]], NOW - 40)
    for n in range(FLOOD):
        assert await relay.push({**template, "id": f"{n:064x}"}) >= 1
    elsewhere = author.sign(9, "elsewhere", [["h", new_channel()]], NOW - 30)
    off_filter = author.sign(1, "kind 1", [["h", channel]], NOW - 30)
    long_content = author.sign(9, "x" * (MAX_CONTENT_BYTES + 1), [["h", channel]], NOW - 30)
    long_json = author.sign(9, "s", [["h", channel], ["t", "x" * MAX_ENCODED_EVENT_BYTES]], NOW - 30)
    good = author.sign(9, "good", [["h", channel]], NOW - 20)
    for event in (elsewhere, off_filter, long_content, long_json, good):
        await relay.push(event)
    reads = len(relay.received)

    async def good_arrived() -> bool:
        return _ids(await w.read()) == [good["id"], w.first["id"]]

    await _until(good_arrived)
    assert w.pool.windows is not None and len(w.pool.windows) == 1
    assert [m[0] for m in relay.received[reads:]] == [], "every poll was answered by the window"
    dropped = [r for r in caplog.records if getattr(r, "buzz_event", None) == "read.event_dropped"]
    assert 1 <= len(dropped) <= channel_read.DROP_LINES + 1


async def test_a_relay_that_refuses_every_window_costs_the_log_one_line(
        caplog: pytest.LogCaptureFixture) -> None:
    # During an outage every poll of a fleet tries to open its window, and each try was
    # a line; a relay that closes every subscription at once, likewise for each drop.
    from daemon.relay.paging import Page
    from daemon.relay.pool import RelayUnavailable

    class Refusing:
        async def subscribe(self, *_: object) -> object:
            raise RelayUnavailable("down")

    cache = WindowCache(Refusing(), depth=10, keep=10)  # type: ignore[arg-type]
    caplog.set_level(logging.INFO, logger="buzz_broker.read")

    async def empty() -> Page[Any]:
        return Page(items=(), next_position=None, rounds=1)

    for n in range(50):
        key = WindowKey(f"{n % 4:064x}", new_channel(), False)
        page, window = await cache.open(key, [{"kinds": [9]}], lambda item: None, empty,
                                        max_page_bytes=1 << 20, size_of=len)
        assert window is None and page.items == ()
    lines = [r for r in caplog.records
             if getattr(r, "buzz_event", None) == "read.window_not_opened"]
    assert len(lines) == 1 and cache.not_opened.total == 50

    class Closing:
        async def subscribe(self, *_: object) -> object:
            return type("Subscription", (), {"close": lambda self: None})()

    cache = WindowCache(Closing(), depth=10, keep=10)  # type: ignore[arg-type]
    for n in range(50):
        key = WindowKey(f"{n % 4:064x}", new_channel(), False)
        _, window = await cache.open(key, [{"kinds": [9]}], lambda item: None, empty,
                                     max_page_bytes=1 << 20, size_of=len)
        assert window is not None
        window.ended("closed by the relay")
    lines = [r for r in caplog.records
             if getattr(r, "buzz_event", None) == "read.window_dropped"]
    assert len(lines) == 1 and cache.dropped.total == 50


# --- what a relay can make a window being opened cost (before its page is in) --------


def _filling_window(cache: WindowCache, *, depth: int, max_page_bytes: int,
                    size_of: Callable[[Any], int], judged: list[str]) -> Any:
    """A Window of `cache` not filled yet, whose judge accepts every event and records
    each item it was asked to judge (each a signature check in channel_read's judge)."""
    from daemon.relay.windows import Window

    from buzzwire.contract import Event

    def accept(item: Any) -> Event | None:
        judged.append(str(item["id"]))
        return Event.from_json_obj(item)

    return Window(cache, WindowKey(TestKey().pubkey, new_channel(), False), accept, depth,
                  max_page_bytes, size_of, depth)


def test_a_filling_window_judges_at_most_depth_items() -> None:
    """A window of depth 3 fed a fourth item before its page is in ends ("too many
    events while filling"): that item is not judged, and the page is not kept."""
    from daemon.relay.paging import Page

    events = _events(4)
    judged: list[str] = []
    cache = WindowCache(None, depth=3, keep=3)  # type: ignore[arg-type]
    window = _filling_window(cache, depth=3, max_page_bytes=1 << 20, size_of=lambda e: 1,
                             judged=judged)
    for event in events[:3]:
        window.event(event.to_json_obj(), live=False)
    assert window.valid and len(judged) == 3
    window.event(events[3].to_json_obj(), live=False)
    assert not window.valid and cache.dropped.total == 1
    assert judged == [e.id for e in events[:3]], "the item past depth was not judged"
    window.event(TestKey().sign(9, "later", [["h", window.key.channel_id]], NOW), live=True)
    assert len(judged) == 3, "an ended window judges nothing more"
    assert not window.fill(Page(items=tuple(events[:3]), next_position=None, rounds=1))


def test_a_filling_window_holds_at_most_max_page_bytes() -> None:
    """Items that arrive before the page, within `depth` but together past
    `max_page_bytes`, end the window: what it holds meanwhile stays within a page."""
    from daemon.relay.paging import Page

    events = _events(3)
    judged: list[str] = []
    cache = WindowCache(None, depth=10, keep=10)  # type: ignore[arg-type]
    window = _filling_window(cache, depth=10, max_page_bytes=100, size_of=lambda e: 50,
                             judged=judged)
    window.event(events[0].to_json_obj(), live=False)
    window.event(events[1].to_json_obj(), live=False)
    assert window.valid, "100 bytes pending: at the bound, not past it"
    window.event(events[2].to_json_obj(), live=False)
    assert not window.valid and cache.dropped.total == 1
    assert not window.fill(Page(items=tuple(events), next_position=None, rounds=1))


async def test_a_relay_ignoring_the_live_limit_is_answered_cold_and_no_window_is_kept(
        scripted_relay: Callable[[Script], Awaitable[ScriptedRelay]], tmp_path: Path,
        nursery: trio.Nursery, caplog: pytest.LogCaptureFixture) -> None:
    """The scripted relay answers the window's live REQ (`limit` 1) with every event it
    holds, before EOSE: past `depth` (3) of them the window ends while filling, the read
    is answered from the relay as a cold read, and nothing is kept."""
    relay = await scripted_relay(Script(challenge_at_connect=True, require_auth=True))
    reader, author = TestKey(), TestKey()
    channel = new_channel()
    queries: Counter[str] = Counter()
    pool = _pool(relay.url, reader, author, queries=queries)
    pool.windows = WindowCache(pool, depth=3, keep=3)
    await nursery.start(pool.run)
    posted = [author.sign(9, f"m{n}", [["h", channel]], NOW - 50 + n) for n in range(4)]
    for ev in posted:
        assert isinstance(await pool.publish(author.pubkey, signed(ev)), Accepted)
    ctx = context(pool, principal_for(tmp_path, reader.pubkey, [channel]),
                  CursorCodec.open(str(tmp_path)))
    caplog.set_level(logging.INFO, logger="buzz_broker.read")
    verdict = await channel_read.execute(ctx, ChannelReadArgs(channel_id=channel, limit=3))
    assert _ids(verdict) == [ev["id"] for ev in reversed(posted)][:3]
    assert len(pool.windows) == 0
    dropped = [getattr(r, "buzz_fields")["reason"] for r in caplog.records
               if getattr(r, "buzz_event", None) == "read.window_dropped"]
    assert dropped == ["too many events while filling"]
    # The live subscription was closed with the window: nothing holds the connection.
    conn = pool._connections[reader.pubkey]
    assert conn.live == 0


def _newer(window: Any, count: int) -> list[dict[str, Any]]:
    author = TestKey()
    return [author.sign(9, f"live{n}", [["h", window.key.channel_id]], NOW + 1 + n)
            for n in range(count)]


def test_live_events_keep_a_window_within_keep() -> None:
    # `keep` bounds one window's events: each live event above the bottom pushes the
    # bottom one out (a cursor is due from there on), however many a relay sends.
    cache = WindowCache(None, depth=3, keep=3)  # type: ignore[arg-type]
    window, _ = _bare_window(cache, _events(3), keep=3)
    live = _newer(window, 5)
    for item in live:
        window.event(item, live=True)
    assert window.valid
    served = window.serve(3)
    assert served is not None and [e.id for e in served.messages] == [e["id"] for e in live[::-1][:3]]
    assert served.next_position is not None
    assert len(window._held) == 3  # white box: nothing kept below the page


def test_a_deletion_with_a_malformed_e_tag_does_not_break_the_reader() -> None:
    # Window.event runs in the connection's reader task and must not raise: a live
    # deletion whose "e" value is not a string (a list, an object) names nothing.
    cache = WindowCache(None, depth=2, keep=10)  # type: ignore[arg-type]
    window, bottom = _bare_window(cache, _events(2))
    for value in (["x"], {"x": 1}):
        window.event({"kind": 5, "tags": [["e", value]], "id": "00" * 32}, live=True)
    assert window.valid


def test_what_a_check_notes_is_bounded_by_keep() -> None:
    # The ids that arrive live while a check is read are noted, at most `keep` of them.
    cache = WindowCache(None, depth=2, keep=4)  # type: ignore[arg-type]
    window, _ = _bare_window(cache, _events(2), keep=4)
    window.begin_check()
    for item in _newer(window, 10):
        window.event(item, live=True)
    assert len(window._arrived) <= 4  # white box: the set a relay's flood would grow


def _window(cache: WindowCache, depth: int = 3, keep: int = 10) -> Any:
    return Window(cache, WindowKey(TestKey().pubkey, new_channel(), False), Event.from_json_obj,
                  depth, 1 << 20, lambda e: 1, keep)


def _at(event: Any) -> Position:
    return Position(created_at=event.created_at, event_id=event.id)


def test_a_page_with_an_overflowing_second_is_not_kept() -> None:
    """A page paging could not read exactly (a second holding the relay's cap or more) is
    the cold read's answer once, never a window every later poll is answered from."""
    events = _events(3)
    cache = WindowCache(None, depth=3, keep=10)  # type: ignore[arg-type]
    window = _window(cache)
    assert not window.fill(Page(items=tuple(events), next_position=None, rounds=1,
                                overflow_seconds=(events[0].created_at,)))
    window = _window(cache)
    assert window.fill(Page(items=tuple(events), next_position=None, rounds=1))
    window.end("test")


def test_a_page_that_delivered_nothing_but_has_a_cursor_is_not_kept() -> None:
    """A cold page that stopped at its round bound before delivering anything (no events,
    a cursor) says nothing of the channel's newest events: no window is kept from it (it
    could never answer, and would hold a subscription slot and its bytes)."""
    events = _events(2)
    cache = WindowCache(None, depth=3, keep=10)  # type: ignore[arg-type]
    window = _window(cache)
    assert not window.fill(Page(items=(), next_position=_at(events[0]), rounds=8))
    # An empty channel (no events, no cursor) is a window.
    window = _window(cache)
    assert window.fill(Page(items=(), next_position=None, rounds=1))
    window.end("test")


def test_a_check_whose_newest_second_overflowed_confirms_nothing() -> None:
    """The check's page must be exact to vouch for the window: one with an overflowing
    second (the relay's cap reached inside one second) does not confirm it."""
    events = _events(4)
    cache = WindowCache(None, depth=3, keep=10)  # type: ignore[arg-type]
    window = _window(cache)
    assert window.fill(Page(items=tuple(events[:3]), next_position=_at(events[2]), rounds=1))
    check = Page(items=tuple(events[:2]), next_position=_at(events[1]), rounds=1)
    window.begin_check()
    assert window.confirms(check)
    window.begin_check()
    assert not window.confirms(Page(items=check.items, next_position=check.next_position,
                                    rounds=1, overflow_seconds=(events[0].created_at,)))
    window.end("test")


def test_a_check_finding_older_events_a_complete_window_lacks_does_not_confirm_it() -> None:
    """A window that holds the whole channel (nothing below it) answers its last page with
    no cursor. If the relay's fresh page runs past the window's bottom, the relay holds
    events the window does not know (an agent re-admitted, a window that missed them): the
    window is not confirmed, or every later poll would end the channel early."""
    events = _events(4)
    cache = WindowCache(None, depth=3, keep=10)  # type: ignore[arg-type]
    window = _window(cache)
    assert window.fill(Page(items=tuple(events[:2]), next_position=None, rounds=1))
    window.begin_check()
    assert not window.confirms(Page(items=tuple(events[:3]), next_position=_at(events[2]), rounds=1))
    window.end("test")


def test_a_continuation_page_with_an_overflowing_second_is_not_kept() -> None:
    """As for the first page: a continuation page paging could not read exactly answers
    its own read only; the window is not extended by it."""
    events = _events(6)
    cache = WindowCache(None, depth=2, keep=10)  # type: ignore[arg-type]
    window, bottom = _bare_window(cache, events[:2])
    mark = window.continuation(bottom)
    assert mark is not None
    window.extend(mark, Page(items=tuple(events[2:4]), next_position=_at(events[3]), rounds=1,
                             overflow_seconds=(events[3].created_at,)))
    assert window.serve(2, bottom) is None, "the overflowing page was not kept"
    mark = window.continuation(bottom)
    assert mark is not None
    window.extend(mark, Page(items=tuple(events[2:4]), next_position=_at(events[3]), rounds=1))
    served = window.serve(2, bottom)
    assert served is not None and [e.id for e in served.messages] == [e.id for e in events[2:4]]
    window.end("test")


def test_a_continuation_keeps_a_window_within_keep() -> None:
    """`keep` bounds a window's events whatever fills it: a continuation page that takes
    it past `keep` drops its bottom events again (a cursor is due from there on)."""
    events = _events(6)
    cache = WindowCache(None, depth=2, keep=3)  # type: ignore[arg-type]
    window, bottom = _bare_window(cache, events[:2], keep=3)
    mark = window.continuation(bottom)
    assert mark is not None
    window.extend(mark, Page(items=tuple(events[2:4]), next_position=None, rounds=1))
    assert len(window._held) == 3  # white box: nothing kept past `keep`
    served = window.serve(2, bottom)
    assert served is None, "the page runs past the window's bottom, the relay holds the rest"
    window.end("test")


async def test_a_window_not_served_for_idle_seconds_is_closed(autojump_clock: Any) -> None:
    """A window no read has asked for in `idle_seconds` is closed at the next read of any
    window (its subscription and bytes given back), while one served meanwhile stays."""
    cache = WindowCache(None, depth=2, keep=10, idle_seconds=300)  # type: ignore[arg-type]
    idle, _ = _bare_window(cache, _events(2))
    busy, _ = _bare_window(cache, _events(2))
    cache._keep(idle)  # white box: as `open` keeps a window it filled
    cache._keep(busy)
    await trio.sleep(200)
    assert cache.get(busy.key) is busy
    await trio.sleep(200)
    assert cache.get(busy.key) is busy
    assert not idle.valid and cache.get(idle.key) is None and len(cache) == 1
    busy.end("test")
    assert cache.bytes == 0


class _CountingPool:
    """A stand-in for RelayPool.subscribe: counts the live subscriptions opened."""

    def __init__(self) -> None:
        self.opened = 0
        self.closed = 0

    async def subscribe(self, agent: str, filters: Any, sink: Any) -> Any:
        self.opened += 1
        await trio.sleep(1)
        pool = self

        class _Sub:
            def close(self) -> None:
                pool.closed += 1

        return _Sub()


async def test_reads_racing_to_open_one_window_open_one_subscription(autojump_clock: Any) -> None:
    """Two reads of one (agent, channel, mentionsOnly) with no window yet: the first opens
    the window, the other is a plain read, never a second subscription for the same key
    (each one a slot of the agent's connection, under the relay's cap)."""
    events = _events(2)
    pool = _CountingPool()
    cache = WindowCache(pool, depth=2, keep=10)  # type: ignore[arg-type]
    key = WindowKey(TestKey().pubkey, new_channel(), False)

    async def read() -> Page[Any]:
        await trio.sleep(1)
        return Page(items=tuple(events), next_position=None, rounds=1)

    async def one() -> None:
        await cache.open(key, [{"kinds": [9], "#h": [key.channel_id]}], Event.from_json_obj, read,
                         max_page_bytes=1 << 20, size_of=lambda e: 1)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one)
        nursery.start_soon(one)
    assert pool.opened == 1
    assert len(cache) == 1
    cache.close()


async def test_a_failed_cold_read_closes_the_window_subscription(autojump_clock: Any) -> None:
    """The window's live subscription is opened before its page is read: when that read
    fails (relay refused, garbled, unavailable) the subscription is closed with it, or
    each failed poll would hold one more slot of the agent's connection."""
    pool = _CountingPool()
    cache = WindowCache(pool, depth=2, keep=10)  # type: ignore[arg-type]
    key = WindowKey(TestKey().pubkey, new_channel(), False)

    async def read() -> Page[Any]:
        raise RuntimeError("relay refused")

    with pytest.raises(RuntimeError):
        await cache.open(key, [{"kinds": [9], "#h": [key.channel_id]}], Event.from_json_obj, read,
                         max_page_bytes=1 << 20, size_of=lambda e: 1)
    assert (pool.opened, pool.closed) == (1, 1)
    assert len(cache) == 0 and cache.bytes == 0


async def test_a_window_too_large_to_keep_is_not_returned_to_answer_the_read(autojump_clock: Any) -> None:
    """A window that ends as it is kept (alone above read_window_bytes) is not handed to
    the read: served from its emptied lists, a channel it held whole would read as empty.
    The read is answered from the page instead."""
    events = _events(2)
    pool = _CountingPool()
    cache = WindowCache(pool, max_bytes=1000, depth=2, keep=10)  # type: ignore[arg-type]
    key = WindowKey(TestKey().pubkey, new_channel(), False)

    async def read() -> Page[Any]:
        return Page(items=tuple(events), next_position=None, rounds=1)

    page, window = await cache.open(key, [{"kinds": [9], "#h": [key.channel_id]}],
                                    Event.from_json_obj, read, max_page_bytes=1 << 20,
                                    size_of=lambda e: 1)
    assert [e.id for e in page.items] == [e.id for e in events]
    assert window is None
    assert (pool.opened, pool.closed) == (1, 1) and len(cache) == 0


async def test_one_eviction_pass_brings_the_windows_back_within_their_bytes(autojump_clock: Any) -> None:
    """read_window_bytes holds after every change, however many least recently used
    windows it takes: not one eviction per change."""
    cache = WindowCache(None, max_bytes=1 << 30, depth=2, keep=10)  # type: ignore[arg-type]
    windows = []
    for _ in range(4):
        window, _ = _bare_window(cache, _events(2))
        cache._keep(window)  # white box: as `open` keeps a window it filled
        windows.append(window)
    one = cache.bytes // 4
    cache.max_bytes = one + one // 2  # room for one window only
    cache.resized(windows[-1])
    assert cache.bytes <= cache.max_bytes
    assert [w.valid for w in windows] == [False, False, False, True]
    cache.close()
    assert cache.bytes == 0


async def test_a_windows_check_age_is_jittered_down_never_up(autojump_clock: Any) -> None:
    """`max_age` bounds how long a window answers before it is checked against the relay
    (what a relay dropping a member silently can leave in it): the jitter spreads checks
    out below it, never past it."""
    cache = WindowCache(None, depth=2, keep=10, max_age=60.0)  # type: ignore[arg-type]
    window, _ = _bare_window(cache, _events(2))
    ages = []
    for _ in range(200):
        cache.renew(window)
        ages.append(window.max_age)
    assert all(45.0 <= age <= 60.0 for age in ages), (min(ages), max(ages))
    assert max(ages) - min(ages) > 5.0, "the checks are spread out"
    window.end("test")


async def test_an_ended_window_leaves_no_trace_in_the_cache(autojump_clock: Any) -> None:
    """Every ended window gives back its entry in the cache's bookkeeping: nothing grows
    with the number of (agent, channel) pairs ever read."""
    cache = WindowCache(None, depth=2, keep=10)  # type: ignore[arg-type]
    for _ in range(3):
        window, _ = _bare_window(cache, _events(2))
        cache._keep(window)  # white box: as `open` keeps a window it filled
        window.end("test")
    assert len(cache) == 0 and cache.bytes == 0
    assert cache._served_at == {} and cache._held == {}  # white box


def test_a_cache_keeping_fewer_events_than_its_page_is_a_programmer_error() -> None:
    with pytest.raises(ValueError):
        WindowCache(None, depth=10, keep=5)  # type: ignore[arg-type]
    for bad in ({"max_bytes": -1}, {"depth": 0}, {"max_age": 0}, {"idle_seconds": 0}):
        with pytest.raises(ValueError):
            WindowCache(None, **bad)  # type: ignore[arg-type]


async def test_a_window_the_relay_no_longer_confirms_does_not_answer_the_read(
        world: World, local_relay: str, nursery: trio.Nursery) -> None:
    """A due window whose check fails is dropped and the read is answered afresh from the
    relay: never from the dropped window (emptied, it would answer a channel it held whole
    as empty, with no cursor)."""
    pool = _pool(local_relay, world.reader)
    windows = WindowCache(pool, depth=10, keep=10)
    pool.windows = windows
    await nursery.start(pool.run)
    ctx = context(pool, world.ctx.principal, world.ctx.cursors)
    first = await world.read(ctx, limit=10)
    assert len(_ids(first)) == 5 and first.outcome.next_cursor is None  # the window holds it all
    window = windows.get(WindowKey(world.reader.pubkey, world.channel, False))
    assert window is not None
    # What the relay will not confirm: an event the window holds that the relay never had.
    never = Event.from_json_obj(world.author.sign(9, "never published", [["h", world.channel]], NOW))
    window._place(never)  # white box
    window.filled_at -= window.max_age  # white box: due, with no clock to wait on
    again = await world.read(ctx, limit=10)
    assert not window.valid
    assert _ids(again) == _ids(first)


async def test_a_read_deeper_than_the_window_is_a_cold_read(
        world: World, local_relay: str, nursery: trio.Nursery) -> None:
    """A window answers limits up to its depth; a read with a larger limit is the cold
    read, every event the limit asks for, not the window's shorter page with a cursor."""
    pool = _pool(local_relay, world.reader)
    pool.windows = WindowCache(pool, depth=2, keep=10)
    await nursery.start(pool.run)
    ctx = context(pool, world.ctx.principal, world.ctx.cursors)
    deep = await world.read(ctx, limit=5)
    assert len(_ids(deep)) == 5 and deep.outcome.next_cursor is None
