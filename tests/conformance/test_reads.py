"""channel.read against [C2] and I4: signed events verbatim, seven members each, the default
page of 100, `limit` honoured, `nextCursor` present exactly when more exists.

One channel is filled once with more than a default page (rate limits switched off for
the test, as docs/configuration.md allows for benchmarks), plus a foreign kind-9 event
published straight to the relay and a reaction that carries the channel's `h` tag.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import trio

from tests.conformance import _spec
from tests.conformance._wire import Principal, Wire, fetch, known_agent
from tests.fixtures.broker import BrokerHarness
from tests.fixtures.relay import TestKey, nostr_publish, nostr_verify

TOTAL_POSTS = 131  # more than the default page of 100, not a multiple of any limit used
#: Posts in flight at once while filling. Each holds one connection of this process's uid,
#: and the daemon answers 503 past its per-uid connection cap (http.HttpLimits, 128): on a
#: loaded machine every post can be waiting on the relay at the same moment, so the fill
#: must never hold more connections than the cap allows, however slowly posts complete.
POSTS_IN_FLIGHT = 16


def _declared_order(messages: list[dict[str, Any]]) -> bool:
    keys = [(-m["created_at"], m["id"]) for m in messages]
    return keys == sorted(keys)


async def _read_all(wire: Wire, who: Principal, args: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """Every page of a read, following nextCursor verbatim until it is omitted."""
    pages: list[list[dict[str, Any]]] = []
    cursor: str | None = None
    for _ in range(TOTAL_POSTS + 5):
        page = await wire.ok(who, "channel.read", {**args, **({"cursor": cursor} if cursor else {})})
        pages.append(page["messages"])
        cursor = page.get("nextCursor")
        if cursor is None:
            return pages
    raise AssertionError("paging did not end")


async def _fill(broker: BrokerHarness, wire: Wire, writer: Principal, reader: Principal,
                channel: str) -> tuple[set[str], set[str], dict[str, Any]]:
    broker.reconfigure("[limits]\nenabled = false\n")
    ids: set[str] = set()
    mentioning: set[str] = set()

    async def post(index: int) -> None:
        args: dict[str, Any] = {"channelId": channel, "content": f"message {index}"}
        if index % 10 == 0:
            args["mentions"] = [reader.pubkey]
        out = await wire.ok(writer, "message.post", args)
        ids.add(out["eventId"])
        if index % 10 == 0:
            mentioning.add(out["eventId"])

    assert POSTS_IN_FLIGHT < broker.control.per_uid.per_uid
    in_flight = trio.CapacityLimiter(POSTS_IN_FLIGHT)

    async def post_when_free(index: int) -> None:
        async with in_flight:
            await post(index)

    async with trio.open_nursery() as nursery:
        for index in range(TOTAL_POSTS):
            nursery.start_soon(post_when_free, index)
    stranger = TestKey()
    foreign = stranger.sign(9, "from outside the broker — ünïcödé \"q\" \\", [
        ["h", channel], ["client", "elsewhere"], ["p", reader.pubkey], ["x", "", "extra"]],
        int(time.time()))
    assert await trio.to_thread.run_sync(nostr_publish, broker.relay_url, foreign,
                                         stranger.secret_hex)
    ids.add(foreign["id"])
    mentioning.add(foreign["id"])
    # A reaction tagged with the channel is not a channel message.
    await wire.ok(writer, "reaction.add", {"channelId": channel,
                                           "targetEventId": foreign["id"], "reaction": "+"})
    return ids, mentioning, foreign


async def test_pages_limits_and_cursors(broker: BrokerHarness) -> None:
    channel = str(uuid.uuid4())
    writer = await known_agent(broker, "writer", [channel])
    reader = await known_agent(broker, "reader", [channel])
    wire = Wire(broker)
    ids, mentioning, foreign = await _fill(broker, wire, writer, reader, channel)
    relay_copy = {e["id"]: e for e in await fetch(broker, {"kinds": [9], "#h": [channel],
                                                           "limit": 500})}
    assert set(relay_copy) == ids

    # Absent limit: the default page of 100, with a cursor to the rest.
    first = await wire.ok(reader, "channel.read", {"channelId": channel})
    assert len(first["messages"]) == _spec.DEFAULT_PAGE and "nextCursor" in first
    rest = await wire.ok(reader, "channel.read", {"channelId": channel,
                                                  "cursor": first["nextCursor"]})
    assert len(rest["messages"]) == len(ids) - _spec.DEFAULT_PAGE and "nextCursor" not in rest
    everything = first["messages"] + rest["messages"]
    assert [m["id"] for m in everything] == list(dict.fromkeys(m["id"] for m in everything))
    assert {m["id"] for m in everything} == ids
    assert _declared_order(everything)
    for message in everything:
        # I4: the relay's own signed event, verbatim — nothing projected, nothing added.
        assert set(message) == _spec.EVENT_MEMBERS
        assert message == relay_copy[message["id"]]
        assert nostr_verify(message) and message["kind"] in _spec.READ_KINDS
    assert next(m for m in everything if m["id"] == foreign["id"]) == foreign

    # limit honoured; nextCursor present exactly while more exists.
    for limit in (7, _spec.MAX_LIMIT, len(ids), len(ids) - 1):
        pages = await _read_all(wire, reader, {"channelId": channel, "limit": limit})
        assert all(len(p) == limit for p in pages[:-1]), [len(p) for p in pages]
        assert 1 <= len(pages[-1]) <= limit
        flat = [m["id"] for p in pages for m in p]
        assert len(flat) == len(set(flat)) and set(flat) == ids, limit
    exact = await wire.ok(reader, "channel.read", {"channelId": channel, "limit": len(ids)})
    assert len(exact["messages"]) == len(ids) and "nextCursor" not in exact

    # mentionsOnly narrows to events whose p tags name the requester (spec: the wake path).
    pages = await _read_all(wire, reader, {"channelId": channel, "mentionsOnly": True, "limit": 5})
    assert {m["id"] for p in pages for m in p} == mentioning
    # A thread read: the root and what tags it (none here but itself).
    thread = await wire.ok(reader, "channel.read", {"channelId": channel,
                                                    "rootEventId": foreign["id"].upper()})
    assert [m["id"] for m in thread["messages"]] == [foreign["id"]]
    assert "nextCursor" not in thread
    # An empty channel: an empty page and no cursor.
    empty_channel = str(uuid.uuid4())
    lonely = await known_agent(broker, "lonely", [empty_channel])
    empty = await wire.ok(lonely, "channel.read", {"channelId": empty_channel})
    assert empty == {"messages": []}
    assert json.dumps(empty) == '{"messages": []}'
