"""Single sentences of the specs, each held to its letter over the socket.

- §Operations: lengths of names and reactions count characters (Unicode scalar values);
  content counts bytes; content "publishes exactly as written" and is only required to be
  "non-empty".
- I3 / [C2]: a verdict is recorded per principal and requestId, and the identical bytes
  replay it with `replayed: true`.
- buzz-on-the-relay.md "Replies": the root is the parent's `e` tag marked root, else its `e`
  tag marked reply, else the parent itself — parents written by other clients included.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest
import trio

from tests.conformance import _spec
from tests.conformance._wire import Wire, envelope_body, fetch, known_agent
from tests.fixtures.broker import BrokerHarness
from tests.fixtures.relay import TestKey, nostr_publish

#: (action, args, valid?) — the limits as the spec counts them.
LENGTHS: list[tuple[str, dict[str, Any], bool]] = [
    ("profile.set", {"displayName": "😀" * 120}, True),  # 120 scalars, 240 UTF-16 units
    ("profile.set", {"displayName": "😀" * 121}, False),
    ("profile.set", {"about": "é" * 2000}, True),
    ("profile.set", {"about": "é" * 2001}, False),
    ("profile.set", {"picture": "https://x.test/" + "p" * 285}, True),  # 300 characters
    ("profile.set", {"picture": "https://x.test/" + "p" * 286}, False),
    ("message.post", {"content": "x" * _spec.MAX_CONTENT_BYTES}, True),
    ("message.post", {"content": "😀" * (_spec.MAX_CONTENT_BYTES // 4)}, True),
    ("message.post", {"content": "é" * (_spec.MAX_CONTENT_BYTES // 2) + "x"}, False),
    # NIP-BA's bound is 66 scalars; this host takes 64, what Buzz's relay takes (a host
    # may restrict the vocabulary): 65 and 66 are the host's invalid_request.
    ("reaction.add", {"reaction": "👍🏽" * 32}, True),  # 64 scalars (emoji + modifier)
    ("reaction.add", {"reaction": "👍🏽" * 32 + "!"}, False),
    ("reaction.add", {"reaction": "👍🏽" * 33}, False),
    ("reaction.add", {"reaction": "👍🏽" * 33 + "!"}, False),
    # 20,000 scalars of 2 bytes: the record stays under the development relay's 64 KiB.
    ("agents.create", {"displayName": "名" * 120, "systemPrompt": "é" * 20_000}, True),
    ("agents.create", {"displayName": "n", "systemPrompt": "😀" * 20_001}, False),
    ("agents.create", {"displayName": "n", "systemPrompt": "p", "model": "m" * 300}, True),
    ("agents.create", {"displayName": "n", "systemPrompt": "p", "model": "m" * 301}, False),
]


@pytest.mark.broker_config(policy={"models": ["m" * 300]})  # the longest model, declared
async def test_lengths_count_as_the_spec_counts(broker: BrokerHarness) -> None:
    channel = str(uuid.uuid4())
    who = await known_agent(broker, "lengths", [channel])
    wire = Wire(broker)
    target = await wire.ok(who, "message.post", {"channelId": channel, "content": "t"})
    for action, args, succeeds in LENGTHS:
        full = dict(args)
        if action in ("message.post", "reaction.add", "agents.create"):
            full["channelId"] = channel
        if action == "reaction.add":
            full["targetEventId"] = target["eventId"]
        env = await wire.call(who, action, full)
        shape = (action, {k: len(v) for k, v in args.items()}, env)
        if not succeeds:
            assert (env["status"], env["error"]["code"]) == ("failed", "invalid_request"), shape
        elif env["status"] != "succeeded":
            # The development relay (nostr-sdk LocalRelay) caps a whole event at 64 KiB, so
            # the largest contents pass the host's validation and are refused by the relay:
            # a domain failure, not a contract one (Buzz's relay takes frames to 512 KiB).
            assert action == "message.post" and env["error"]["code"] == "action_failed", shape
            assert "size" in env["error"]["message"], shape
    # requestId: 1-128 bytes; 128 correlates, 129 cannot.
    long_id = "r" * 128
    env = await wire.send(envelope_body("profile.set", {"about": "a"}, request_id=long_id),
                          who.credential)
    assert env["requestId"] == long_id and env["status"] == "succeeded"


@pytest.mark.parametrize("content", ["   ", "\n", "\t \u00a0"])
async def test_whitespace_only_content_is_refused_and_padding_is_kept(
    broker: BrokerHarness, content: str
) -> None:
    """Content is never trimmed, but a message of whitespace alone is not a message.

    The spec says content is "required, non-empty" and "publishes exactly as written";
    this host reads "required" as "has something to say" (the issue that specified the
    contract: "content exact but not whitespace-only"), the same rule every other string
    gets after trimming. Padding around real text is published untouched.
    """
    channel = str(uuid.uuid4())
    who = await known_agent(broker, "blank", [channel])
    wire = Wire(broker)
    env = await wire.send(envelope_body("message.post", {"channelId": channel,
                                                         "content": content}), who.credential)
    assert (env["status"], env["error"]["code"]) == ("failed", "invalid_request")
    padded = f"{content}text{content}"
    env = await wire.call(who, "message.post", {"channelId": channel, "content": padded})
    assert env["status"] == "succeeded", env
    [event] = await fetch(broker, {"ids": [env["outcome"]["eventId"]]})
    assert event["content"] == padded


async def test_a_refused_request_replays_its_verdict(broker: BrokerHarness) -> None:
    channel = str(uuid.uuid4())
    broker.reconfigure('[limits]\npublish = "1/h"\n')
    who = await known_agent(broker, "limited", [channel])
    wire = Wire(broker)
    wire.bind(who.credential, who.pubkey)
    first = await wire.call(who, "message.post", {"channelId": channel, "content": "one"})
    assert first["status"] == "succeeded"
    body = envelope_body("message.post", {"channelId": channel, "content": "two"})
    refused = await wire.send(body, who.credential)
    assert (refused["status"], refused["error"]["code"]) == ("failed", "unauthorized")
    broker.reconfigure("enabled = false\n")  # the limit is lifted; the verdict stands
    again = await wire.send(body, who.credential)
    assert again == {**refused, "replayed": True}, again


async def test_reply_root_from_parents_written_elsewhere(broker: BrokerHarness) -> None:
    channel = str(uuid.uuid4())
    who = await known_agent(broker, "replier", [channel])
    wire = Wire(broker)
    stranger = TestKey()
    now = int(time.time())
    # NIP-BA: the root is fetched in the channel, so x and y are real events there.
    roots = [stranger.sign(9, text, [["h", channel]], now) for text in ("x", "y")]
    for event in roots:
        assert await trio.to_thread.run_sync(nostr_publish, broker.relay_url, event,
                                             stranger.secret_hex)
    x, y = (event["id"] for event in roots)
    # (parent's tags besides h, the root the spec's rule derives). An unmarked (positional)
    # parent is refused, not taken for a root: tests/e2e/test_operations.py.
    parents: list[tuple[list[list[str]], str | None]] = [
        ([["e", x, "", "reply"]], x),                           # reply marker only
        ([["e", y, "", "reply"], ["e", x, "", "root"]], x),     # root wins, whatever its place
        ([["e", x, "wss://r.test", "mention"]], None),          # a mention is not ancestry
    ]
    for extra, root in parents:
        parent = stranger.sign(9, "parent", [["h", channel], *extra], now)
        assert await trio.to_thread.run_sync(nostr_publish, broker.relay_url, parent,
                                             stranger.secret_hex)
        out = await wire.ok(who, "message.reply", {"channelId": channel,
                                                   "replyToEventId": parent["id"],
                                                   "content": "answer"})
        [event] = await fetch(broker, {"ids": [out["eventId"]]})
        plain = [t for t in event["tags"] if t[0] != "auth"]
        want = [["h", channel]]
        if root is not None:
            want.append(["e", root, "", "root"])
        want.append(["e", parent["id"], "", "reply"])
        assert plain == want, (extra, event["tags"])
    assert json.dumps(wire.log[-1].envelope)  # every exchange above was checked on arrival
