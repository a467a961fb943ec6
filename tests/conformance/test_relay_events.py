"""What each operation becomes on the relay (buzz-on-the-relay.md), read back independently.

The agents here are imported with a known secret and a NIP-OA tag made by a human owner key
this test holds, so the test can check the tag custody adds (exactly once, verbatim,
verifying) and can sign as the agent itself (a kind 0 with members the host never sets).
Every expectation is a literal row: (operation, kind, author, tags without `auth`, content).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest
import trio

from tests.conformance import _spec
from tests.conformance._wire import Wire, envelope_body, fetch, known_agent, verify_nip_oa
from tests.fixtures.broker import BrokerHarness
from tests.fixtures.relay import TestKey, nostr_publish, nostr_verify


def _split_auth(event: dict[str, Any]) -> tuple[list[list[str]], list[list[str]]]:
    tags = [list(t) for t in event["tags"]]
    return [t for t in tags if t[:1] != ["auth"]], [t for t in tags if t[:1] == ["auth"]]


def _signed_by_owned(event: dict[str, Any], owner: str, tag: list[str] | None = None) -> None:
    """NIP-OA: every event an owned agent signs carries its owner tag exactly once."""
    _, auth = _split_auth(event)
    assert len(auth) == 1, event["tags"]
    assert auth[0][1] == owner and verify_nip_oa(auth[0], event["pubkey"]), auth
    if tag is not None:
        assert auth[0] == tag
    assert nostr_verify(event), event


async def _by_id(broker: BrokerHarness, event_id: str) -> dict[str, Any]:
    found = await fetch(broker, {"ids": [event_id]})
    assert len(found) == 1, (event_id, found)
    return found[0]


async def _newest(broker: BrokerHarness, flt: dict[str, Any]) -> dict[str, Any]:
    found = await fetch(broker, flt)
    assert found, flt
    return max(found, key=lambda e: (e["created_at"], [-b for b in bytes.fromhex(e["id"])]))


async def test_publishing_operations_on_the_relay(broker: BrokerHarness) -> None:
    channel = str(uuid.uuid4())
    a = await known_agent(broker, "writer", [channel])
    wire = Wire(broker)
    m1, m2 = TestKey().pubkey, TestKey().pubkey
    content = "  as written, not trimmed \n\t"
    post = await wire.ok(a, "message.post", {
        "channelId": channel, "content": content, "mentions": [m1.upper(), m2, m1, m2.upper()]})
    reply = await wire.ok(a, "message.reply", {
        "channelId": channel, "replyToEventId": post["eventId"].upper(), "content": "r1",
        "mentions": [m2.upper(), m1]})
    nested = await wire.ok(a, "message.reply", {
        "channelId": channel, "replyToEventId": reply["eventId"], "content": "r2",
        "mentions": [m1]})
    deeper = await wire.ok(a, "message.reply", {
        "channelId": channel, "replyToEventId": nested["eventId"], "content": "r3"})
    reaction = await wire.ok(a, "reaction.add", {
        "channelId": channel, "targetEventId": reply["eventId"].upper(), "reaction": "🎉"})
    profile = await wire.ok(a, "profile.set", {"displayName": "  Writer  "})

    # (outcome, kind, tags without auth, content) — buzz-on-the-relay.md "The nine operations"
    # and "Replies": h, then e(root), then e(reply), then one p per mention, lowercase, once.
    rows: list[tuple[dict[str, Any], int, list[list[str]] | None, str]] = [
        (post, 9, [["h", channel], ["p", m1], ["p", m2]], content),
        (reply, 9, [["h", channel], ["e", post["eventId"], "", "reply"], ["p", m2], ["p", m1]], "r1"),
        (nested, 9, [["h", channel], ["e", post["eventId"], "", "root"],
                     ["e", reply["eventId"], "", "reply"], ["p", m1]], "r2"),
        (deeper, 9, [["h", channel], ["e", post["eventId"], "", "root"],
                     ["e", nested["eventId"], "", "reply"]], "r3"),
        (reaction, 7, None, "🎉"),
        (profile, 0, [], json.dumps({"display_name": "Writer", "name": "Writer"})),
    ]
    tag: list[str] | None = None
    for outcome, kind, tags, text in rows:
        event = await _by_id(broker, outcome["eventId"])
        assert (event["kind"], event["created_at"]) == (kind, outcome["createdAt"]) == (
            outcome["kind"], outcome["createdAt"])
        assert event["pubkey"] == a.pubkey
        plain, auth = _split_auth(event)
        if tags is not None:
            assert plain == tags, (kind, event["tags"])
        else:
            # NIP-25: the target in an e tag; an h tag is the host's harmless choice; no p.
            assert plain in ([["e", reply["eventId"]]], [["e", reply["eventId"]], ["h", channel]],
                             [["h", channel], ["e", reply["eventId"]]]), event["tags"]
        if kind == 0:
            assert json.loads(event["content"]) == json.loads(text)
        else:
            assert event["content"] == text
        _signed_by_owned(event, a.owner.pubkey, tag)
        tag = auth[0]  # the same tag on every event


async def test_profile_set_merges_and_replaces_strictly_later(broker: BrokerHarness) -> None:
    channel = str(uuid.uuid4())
    a = await known_agent(broker, "profiled", [channel])
    seeded = a.key.sign(0, json.dumps({
        "name": "Old", "display_name": "Old", "about": "old about", "nip05": "old@x.test",
        "lud16": "tip@x.test", "website": "https://x.test"}), [], int(time.time()))
    assert await trio.to_thread.run_sync(nostr_publish, broker.relay_url, seeded, a.key.secret_hex)
    wire = Wire(broker)
    steps: list[tuple[dict[str, str], dict[str, str]]] = [
        ({"displayName": "New"}, {"name": "New", "display_name": "New"}),
        ({"about": "fresh"}, {"about": "fresh"}),
        ({"picture": "https://x.test/p.png"}, {"picture": "https://x.test/p.png"}),
        ({"about": " trimmed ", "displayName": "Newer"},
         {"about": "trimmed", "name": "Newer", "display_name": "Newer"}),
    ]
    expected: dict[str, str] = json.loads(seeded["content"])
    last_created = seeded["created_at"]
    started = time.time()
    for args, change in steps:
        outcome = await wire.ok(a, "profile.set", args)
        expected.update(change)
        # Replaceable: strictly later than the version it replaces, even within one second.
        assert outcome["createdAt"] > last_created, (outcome, last_created)
        last_created = outcome["createdAt"]
        newest = await _newest(broker, {"kinds": [0], "authors": [a.pubkey]})
        assert newest["id"] == outcome["eventId"], "the relay kept an older version"
        assert json.loads(newest["content"]) == expected  # absent members untouched
        _signed_by_owned(newest, a.owner.pubkey)
    assert time.time() - started < 5  # the rule was exercised inside a few seconds


@pytest.mark.broker_config(policy={"providers": ["acme"], "models": ["m-1"]})  # declared
async def test_managed_agent_lifecycle_on_the_relay(broker: BrokerHarness) -> None:
    channel = str(uuid.uuid4())
    a = await known_agent(broker, "owner", [channel])
    wire = Wire(broker)
    created = await wire.ok(a, "agents.create", {
        "channelId": "{" + channel.upper() + "}", "displayName": "  Helper  ",
        "systemPrompt": "be brief", "runtime": "goose"})
    k = created["agentPubkey"]
    # Public identity only, echoed canonical and trimmed (I1, §Identities).
    assert created == {"agentPubkey": k, "displayName": "Helper", "channelId": channel}
    assert k == k.lower() and len(k) == 64

    [put_user] = await fetch(broker, {"kinds": [9000], "#p": [k]})
    assert put_user["pubkey"] == a.pubkey
    assert _split_auth(put_user)[0] == [["h", channel], ["p", k], ["role", "bot"]]
    _signed_by_owned(put_user, a.owner.pubkey)
    [profile0] = await fetch(broker, {"kinds": [0], "authors": [k]})
    assert _split_auth(profile0)[0] == []
    assert json.loads(profile0["content"]) == {"display_name": "Helper", "name": "Helper"}
    _signed_by_owned(profile0, a.pubkey)  # the created agent's owner is the requester

    record_filter = {"kinds": [30177], "authors": [a.pubkey], "#d": [k]}
    # No runtime in the world-readable record (Buzz's kind registry); the host keeps it.
    expected: dict[str, object] = {"name": "Helper", "system_prompt": "be brief",
                                   "parallelism": 1, "respond_to": "owner-only"}
    record = await _newest(broker, record_filter)
    assert _split_auth(record)[0] == [["d", k]]
    assert json.loads(record["content"]) == expected
    _signed_by_owned(record, a.owner.pubkey)

    # agents.update: (args, updatedFields = the wire names actually changed, sorted,
    # the record's members after the merge).
    updates: list[tuple[dict[str, Any], list[str], dict[str, object]]] = [
        ({"target": {"pubkey": k.upper()}, "displayName": "Helper", "systemPrompt": "be brief"},
         [], {}),
        ({"target": {"name": "Helper"}, "model": "m-1", "runtime": "goose",
          "respondTo": "owner-only"}, ["model"], {"model": "m-1"}),
        ({"target": {"pubkey": k}, "respondTo": "anyone", "provider": "acme",
          "displayName": "Helper Two", "systemPrompt": " be briefer "},
         ["displayName", "provider", "respondTo", "systemPrompt"],
         {"respond_to": "anyone", "provider": "acme", "name": "Helper Two",
          "system_prompt": "be briefer"}),
    ]
    name = "Helper"
    for args, fields, change in updates:
        previous = record
        outcome = await wire.ok(a, "agents.update", args)
        expected.update(change)
        name = str(expected["name"])
        assert outcome == {"agentPubkey": k, "displayName": name, "updatedFields": fields}
        record = await _newest(broker, record_filter)
        assert json.loads(record["content"]) == expected
        assert set(expected) <= _spec.RECORD_REQUIRED | _spec.RECORD_OPTIONAL
        assert not set(expected) & _spec.RECORD_NEVER
        if fields:
            assert record["created_at"] > previous["created_at"], "30177 not strictly later"
            _signed_by_owned(record, a.owner.pubkey)
    renamed = await _newest(broker, {"kinds": [0], "authors": [k]})
    assert json.loads(renamed["content"]) == {"display_name": "Helper Two", "name": "Helper Two"}
    assert renamed["created_at"] > profile0["created_at"]
    _signed_by_owned(renamed, a.pubkey)

    # The created agent's own message: its owner tag, once.
    kid_credential = broker.credential(k, [channel])
    wire.bind(kid_credential, k)
    said = await wire.send(envelope_body("message.post", {"channelId": channel, "content": "hi"}),
                           kid_credential)
    event = await _by_id(broker, said["outcome"]["eventId"])
    assert event["pubkey"] == k and _split_auth(event)[0] == [["h", channel]]
    _signed_by_owned(event, a.pubkey)

    deleted = await wire.ok(a, "agents.delete", {"target": {"name": "Helper Two"}})
    assert deleted == {"agentPubkey": k, "displayName": "Helper Two"}
    [deletion] = await fetch(broker, {"kinds": [5], "authors": [a.pubkey]})
    assert _split_auth(deletion)[0] == [["a", f"30177:{a.pubkey}:{k}"], ["k", "30177"]]
    _signed_by_owned(deletion, a.owner.pubkey)


async def test_identity_spellings_are_read_as_canonical(broker: BrokerHarness) -> None:
    """§Identities: uppercase, unhyphenated, braces and urn:uuid: channel ids are the
    canonical id; the echo and every tag carry the canonical form."""
    channel = str(uuid.uuid4())
    a = await known_agent(broker, "spelling", [channel])
    wire = Wire(broker)
    plain = channel.replace("-", "")
    # NIP-BA's spellings (tests/contract/test_text_rules.py refuses the others).
    spellings = [channel.upper(), plain, plain.upper(), "{" + channel + "}", "{" + channel.upper() + "}",
                 "urn:uuid:" + channel, "urn:uuid:" + channel.upper(), "  " + channel + "\n"]
    posted: list[str] = []
    for index, spelling in enumerate(spellings):
        out = await wire.ok(a, "message.post", {"channelId": spelling, "content": f"s{index}"})
        posted.append(out["eventId"])
        if index % 3 == 0:
            created = await wire.ok(a, "agents.create", {
                "channelId": spelling, "displayName": f"S{index}", "systemPrompt": "p"})
            assert created["channelId"] == channel, (spelling, created)
    for event_id in posted:
        event = await _by_id(broker, event_id)
        assert _split_auth(event)[0] == [["h", channel]]
    puts = await fetch(broker, {"kinds": [9000], "authors": [a.pubkey]})
    assert puts and all(_split_auth(e)[0][0] == ["h", channel] for e in puts)
    for spelling in spellings:
        page = await wire.ok(a, "channel.read", {"channelId": spelling})
        assert sorted(m["id"] for m in page["messages"]) == sorted(posted)
