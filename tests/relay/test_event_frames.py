"""A live EVENT frame whose text after its subscription id was parsed before is handed
that parse (daemon/relay/pool.py `_EventBodies`, protocol `split_event_frame`): only for
exactly those bytes, only to live subscriptions, and the read path still judges every
event it is handed (a forged copy of a known id is refused, not vouched for).

The frames go through the pool's own reader (`RelayPool._read`) from a stand-in for the
WebSocket, which is all the reader asks of it; the windows fed are the read path's own.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest
import trio_websocket

from buzzwire.contract import Event, page_bytes
from daemon.operations import channel_read
from daemon.relay import pool as pool_module
from daemon.relay.paging import Page
from daemon.relay.pool import (
    MAX_EVENTS_PER_QUERY,
    RelayPool,
    _Connection,
    _EventBodies,
    _Live,
    _ResultBudget,
    _Subscription,
    decoded_size,
)
from daemon.relay.protocol import EventMessage, parse_relay_message, split_event_frame
from daemon.relay.windows import Window, WindowCache, WindowKey
from tests.fixtures.relay import TestKey, auth_signer_for
from tests.read._support import NOW, new_channel


class _Frames:
    """What `RelayPool._read` asks of a WebSocket: frames, then the close."""

    def __init__(self, frames: list[str]) -> None:
        self._frames = list(frames)

    async def get_message(self) -> str:
        if not self._frames:
            raise trio_websocket.ConnectionClosed(None)
        return self._frames.pop(0)


class _Sink:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def event(self, event: dict[str, Any], *, live: bool) -> None:
        self.events.append(event)

    def ended(self, reason: str) -> None:
        pass


def _frame(sub_id: str, event: dict[str, Any]) -> str:
    return json.dumps(["EVENT", sub_id, event], separators=(",", ":"), ensure_ascii=False)


def _pool() -> RelayPool:
    return RelayPool("ws://127.0.0.1:1", auth_signer_for(TestKey()))


async def _read(pool: RelayPool, conn: _Connection, frames: list[str]) -> str:
    return await pool._read(conn, _Frames(frames))  # type: ignore[arg-type]


def test_split_takes_only_frames_that_parse_as_their_prefix_says() -> None:
    ev = TestKey().sign(9, 'a "quoted" \\ and ü', [["h", "x"]], NOW)
    body = json.dumps(ev, separators=(",", ":"), ensure_ascii=False) + "]"
    assert split_event_frame('["EVENT","q7",' + body) == ("q7", body)
    for frame in ['["EVENT", "q7",' + body,  # whitespace: not this exact start
                  '["EVENT","q\\u0037",' + body,  # an escape reads as another id
                  '["EVENT","q\\"7",' + body,
                  '["EVENT","",' + body,
                  '["EVENT","' + "q" * 65 + '",' + body,
                  '["OK","q7",' + body,
                  ' ["EVENT","q7",' + body]:
        assert split_event_frame(frame) is None, frame
    # Any id the split takes, with the same rest, parses to the same event.
    for sub_id in ("q0", "q123", "x y!#[]~", "q" * 64):
        msg = parse_relay_message(f'["EVENT","{sub_id}",' + body)
        assert msg == EventMessage(subscription_id=sub_id, event=ev)


async def test_the_same_bytes_are_parsed_once_and_only_for_live_subscriptions() -> None:
    pool = _pool()
    author = TestKey()
    ev = author.sign(9, "hello", [["h", "x"]], NOW)
    conns, sinks = [], []
    for agent in ("a", "b"):
        conn = _Connection(agent, _ResultBudget(1 << 30), pool._notices)
        conn.alive = True
        sink = _Sink()
        _, live = conn.open_live(sink)
        live.on_eose()
        conns.append(conn)
        sinks.append(sink)
    assert await _read(pool, conns[0], [_frame("q0", ev)])
    assert await _read(pool, conns[1], [_frame("q0", ev)])
    assert sinks[0].events == sinks[1].events == [ev]
    assert sinks[1].events[0] is sinks[0].events[0], "the second copy was not parsed again"
    # A query is the caller's own list: never the shared object.
    query_conn = _Connection("c", _ResultBudget(1 << 30), pool._notices)
    query_conn.alive = True
    sub_id, sub = query_conn.open_subscription()
    assert isinstance(sub, _Subscription)
    await _read(pool, query_conn, [_frame(sub_id, ev)])
    assert sub.events == [ev] and sub.events[0] is not sinks[0].events[0]
    # One byte of difference (the same id and signature over other content) is parsed
    # afresh, and is what it says.
    forged = {**ev, "content": "hellp"}
    await _read(pool, conns[0], [_frame("q0", forged)])
    assert sinks[0].events[-1] == forged and sinks[0].events[-1] is not sinks[0].events[0]
    # A rest that is not an event breaks the protocol as it always did.
    assert "protocol error" in await _read(pool, conns[0], ['["EVENT","q0",{"a":1,"a":2}]'])
    assert "protocol error" in await _read(pool, conns[0], ['["EVENT","q0",' + json.dumps(ev) + ',1]'])


async def test_a_forged_copy_of_a_known_event_is_judged_and_refused() -> None:
    """The forged frame differs only in content from one every window was fed: it is
    parsed afresh, judged from scratch (the id no longer hashes its members) and kept
    out of the window; the genuine event stays."""
    pool = _pool()
    author, channel = TestKey(), new_channel()
    genuine = author.sign(9, "the real text", [["h", channel]], NOW)
    forged = {**genuine, "content": "another text"}
    windows = []
    cache = WindowCache(pool, depth=10, keep=10)
    # The daemon's one log and one cache of judged events, as every read shares them.
    drops, judged = channel_read.ReadLog(), channel_read.JudgedCache(1 << 20)
    for agent in ("a" * 64, "b" * 64):
        conn = _Connection(agent, _ResultBudget(1 << 30), pool._notices)
        conn.alive = True
        filters = [{"kinds": [9, 40002], "#h": [channel]}]
        judge = channel_read._Judge(channel, filters, "window", drops, judged)
        window = Window(cache, WindowKey(agent, channel, False), judge, 10, 1 << 20,
                        page_bytes, 10)
        assert window.fill(Page(items=(), next_position=None, rounds=1))
        _, live = conn.open_live(window)
        live.on_eose()
        windows.append((conn, window))
    for conn, _window in windows:
        await _read(pool, conn, [_frame("q0", genuine)])
    conn, window = windows[0]
    await _read(pool, conn, [_frame("q0", forged)])
    for _conn, window in windows:
        served = window.serve(10)
        assert served is not None
        assert [(e.id, e.content) for e in served.messages] == [(genuine["id"], "the real text")]


def test_the_parsed_bodies_stay_within_their_bytes() -> None:
    bodies = pool_module._EventBodies(20_000)
    author = TestKey()
    for n in range(200):
        ev = author.sign(9, f"message {n}", [["h", "x"]], NOW - n)
        bodies.put(json.dumps(ev) + "]", ev)
        assert bodies.bytes <= 20_000
    assert 0 < bodies.bytes
    assert bodies.get(json.dumps(ev) + "]") is ev, "the newest is kept"
    big = author.sign(9, "x" * 30_000, [["h", "x"]], NOW)
    bodies.put(json.dumps(big) + "]", big)
    assert bodies.get(json.dumps(big) + "]") is None, "one body above the bound is not kept"


@pytest.mark.parametrize("content", ["plain", "ü ✓ 💡", 'quote " and \\ backslash'])
def test_a_cached_body_parses_to_the_event_a_full_parse_gives(content: str) -> None:
    ev = TestKey().sign(9, content, [["h", "x"]], NOW)
    assert Event.from_json_obj(ev).to_json_obj() == ev
    for ensure_ascii in (False, True):
        frame = json.dumps(["EVENT", "q1", ev], separators=(",", ":"), ensure_ascii=ensure_ascii)
        parts = split_event_frame(frame)
        assert parts is not None
        assert parse_relay_message(f'["EVENT","q9",{parts[1]}') == EventMessage(
            subscription_id="q9", event=ev)


async def test_a_live_subscription_tells_stored_events_from_live_ones() -> None:
    # The window reads live=False as history its page already reflects (a stored
    # deletion must not end it); only events after EOSE are live.
    pool = _pool()
    author = TestKey()
    stored, fresh = (author.sign(9, text, [["h", "x"]], NOW) for text in ("old", "new"))
    seen: list[tuple[str, bool]] = []

    class Sink(_Sink):
        def event(self, event: dict[str, Any], *, live: bool) -> None:
            seen.append((event["content"], live))

    conn = _Connection("a", _ResultBudget(1 << 30), pool._notices)
    conn.alive = True
    sub_id, _ = conn.open_live(Sink())
    await _read(pool, conn, [_frame(sub_id, stored), f'["EOSE","{sub_id}"]', _frame(sub_id, fresh)])
    assert seen == [("old", False), ("new", True)]


async def test_what_a_relay_sends_after_eose_does_not_change_a_query() -> None:
    # A query is the events until EOSE: an EVENT after it is not part of the answer, and
    # a CLOSED after it does not turn a complete answer into a refusal.
    pool = _pool()
    author = TestKey()
    first, late = (author.sign(9, text, [["h", "x"]], NOW) for text in ("first", "late"))
    conn = _Connection("a", _ResultBudget(1 << 30), pool._notices)
    conn.alive = True
    sub_id, sub = conn.open_subscription()
    assert isinstance(sub, _Subscription)
    await _read(pool, conn, [_frame(sub_id, first), f'["EOSE","{sub_id}"]', _frame(sub_id, late),
                             f'["CLOSED","{sub_id}","error: shutting down"]'])
    assert sub.events == [first]
    assert sub.closed is None and sub.complete


def test_a_query_past_its_event_bound_ends_at_once_and_holds_nothing() -> None:
    # Past MAX_EVENTS_PER_QUERY the query fails now (not at the relay's EOSE, which a
    # hostile relay never sends) and its bytes go back to the pool's budget at once,
    # before the querying task even runs (other queries' events arrive meanwhile).
    budget = _ResultBudget(1 << 30)
    sub = _Subscription(budget)
    for i in range(MAX_EVENTS_PER_QUERY):
        sub.on_event({"n": i})
    assert not sub.done.is_set() and budget.used > 0
    sub.on_event({"n": -1})
    assert sub.done.is_set() and sub.overflow == "query"
    assert budget.used == 0 and sub.events == []


def test_the_result_budget_admits_exactly_its_total() -> None:
    budget = _ResultBudget(100)
    assert budget.take(100)
    assert not budget.take(1)
    budget.give_back(100)
    assert budget.used == 0


async def test_a_dropped_connection_ends_an_established_live_subscription() -> None:
    # A window whose connection dropped must hear it (`ended`), or it keeps answering
    # reads from a subscription that no longer receives anything.
    pool = _pool()
    ended: list[str] = []

    class Sink(_Sink):
        def ended(self, reason: str) -> None:
            ended.append(reason)

    conn = _Connection("a", _ResultBudget(1 << 30), pool._notices)
    conn.alive = True
    sub_id, live = conn.open_live(Sink())
    await _read(pool, conn, [f'["EOSE","{sub_id}"]'])
    conn.mark_dead()
    assert ended == ["connection dropped"]
    conn.mark_dead()  # once only
    assert ended == ["connection dropped"]


def test_parsed_event_bodies_stay_within_their_bound() -> None:
    # EVENT_BODIES_BYTES is a bound on what the kept parses hold, whatever the mix of
    # sizes a relay sends: one large body evicts as many small ones as it takes.
    author = TestKey()
    small = [author.sign(9, str(i), [["h", "x"]], NOW) for i in range(20)]
    large = author.sign(9, "y" * 4000, [["h", "x"]], NOW)
    costs = [sys.getsizeof(f"rest{i}") + decoded_size(ev) for i, ev in enumerate(small)]
    bodies = _EventBodies(max_bytes=sum(costs))
    for i, ev in enumerate(small):
        bodies.put(f"rest{i}", ev)
    assert bodies.bytes == bodies.max_bytes  # full
    assert sys.getsizeof("large") + decoded_size(large) > 2 * max(costs)  # takes several
    bodies.put("large", large)
    assert bodies.bytes <= bodies.max_bytes
    assert bodies.get("large") is large
    assert bodies.bytes == sum(cost for _, cost in bodies._entries.values())
