"""presence.set and typing.set on a real relay (NIP-BA "Live signals"), read by a live subscriber.

Kinds 20001 and 20002 are ephemeral: the relay forwards them and stores nothing, so the
test subscribes first (tests/fixtures/live.py) and reads each event as the relay forwards
it. Every expectation is a literal row: (action, args, kind, tags without `auth`, content).
"""

from __future__ import annotations

import uuid
from typing import Any

import trio

from tests.conformance._wire import Wire, envelope_body, known_agent, verify_nip_oa
from tests.fixtures.broker import BrokerHarness
from tests.fixtures.live import LiveFeed, live_subscription
from tests.fixtures.relay import TestKey, nostr_publish, nostr_verify

#: A stored kind the test itself publishes as a marker after a request was answered.
MARKER_KIND = 1


def _assert_signal(event: dict[str, Any], outcome: dict[str, Any], agent: str, owner: str,
                   kind: int, tags: list[list[str]], content: str) -> None:
    assert nostr_verify(event), event
    assert event["id"] == outcome["eventId"] and event["created_at"] == outcome["createdAt"]
    assert event["pubkey"] == agent and event["kind"] == kind == outcome["kind"]
    assert event["content"] == content
    plain = [t for t in event["tags"] if t[:1] != ["auth"]]
    auth = [t for t in event["tags"] if t[:1] == ["auth"]]
    assert plain == tags, event["tags"]
    # NIP-OA: an owned agent's every event carries its owner tag, live signals included
    # (custody adds it on every kind it signs; the signing path has no per-kind exception).
    assert len(auth) == 1 and auth[0][1] == owner and verify_nip_oa(auth[0], agent), auth


async def _nothing_more(broker: BrokerHarness, feed: LiveFeed, marker_key: TestKey) -> None:
    """The next event on the feed is a marker published now: nothing came before it."""
    marker = marker_key.sign(MARKER_KIND, "marker " + uuid.uuid4().hex)
    assert await trio.to_thread.run_sync(
        nostr_publish, broker.relay_url, marker, marker_key.secret_hex)
    assert (await feed.next_event())["id"] == marker["id"]


async def test_live_signals_reach_the_relay_and_a_replay_sends_nothing(
        broker: BrokerHarness) -> None:
    channel = str(uuid.uuid4())
    a = await known_agent(broker, "live", [channel])
    wire = Wire(broker)
    reader, marker_key = TestKey(), TestKey()
    rows: list[tuple[str, dict[str, Any], int, list[list[str]], str]] = [
        ("presence.set", {"status": "online"}, 20001, [], "online"),
        ("presence.set", {"status": " away "}, 20001, [], "away"),
        ("typing.set", {"channelId": channel.upper()}, 20002, [["h", channel]], ""),
        ("presence.set", {"status": "offline"}, 20001, [], "offline"),
    ]
    filters = [{"kinds": [20001, 20002], "authors": [a.pubkey]},
               {"kinds": [MARKER_KIND], "authors": [marker_key.pubkey]}]
    async with live_subscription(broker.relay_url, reader, filters) as feed:
        for action, args, kind, tags, content in rows:
            body = envelope_body(action, args)
            wire.bind(a.credential, a.pubkey)
            first = await wire.send(body, a.credential)
            assert first["status"] == "succeeded" and "replayed" not in first, first
            _assert_signal(await feed.next_event(), first["outcome"], a.pubkey, a.owner.pubkey,
                           kind, tags, content)

            # A replay (identical bytes, same requestId) answers the stored verdict and
            # republishes nothing (NIP-BA "Execution and retries" 3).
            again = await wire.send(body, a.credential)
            assert again["replayed"] is True and again["outcome"] == first["outcome"], again
            await _nothing_more(broker, feed, marker_key)

            # A renewal is a new operation: a fresh requestId, a fresh signal on the relay.
            renewed = await wire.ok(a, action, args)
            _assert_signal(await feed.next_event(), renewed, a.pubkey, a.owner.pubkey,
                           kind, tags, content)


async def test_typing_outside_the_credentials_channels_sends_nothing(
        broker: BrokerHarness) -> None:
    channel, elsewhere = str(uuid.uuid4()), str(uuid.uuid4())
    a = await known_agent(broker, "typist", [channel])
    wire = Wire(broker)
    reader, marker_key = TestKey(), TestKey()
    filters = [{"kinds": [20002], "authors": [a.pubkey]},
               {"kinds": [MARKER_KIND], "authors": [marker_key.pubkey]}]
    async with live_subscription(broker.relay_url, reader, filters) as feed:
        refused = await wire.call(a, "typing.set", {"channelId": elsewhere})
        assert refused["status"] == "failed" and refused["error"]["code"] == "unauthorized"
        bad = await wire.call(a, "presence.set", {"status": "busy"})
        assert bad["status"] == "failed" and bad["error"]["code"] == "invalid_request"
        await _nothing_more(broker, feed, marker_key)

