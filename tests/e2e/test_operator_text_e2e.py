"""Issue 22 M3 through the real daemon and relay: a name that would drive the operator's
terminal is refused before anything happens; message content is published exactly."""

from __future__ import annotations

import uuid

import trio

from tests.fixtures.broker import BrokerHarness
from tests.fixtures.relay import nostr_fetch

#: The issue's name: sets the window title, erases the line, returns to column 0.
HOSTILE = "\x1b]0;owned\x07\x1b[2K\rBob"


async def test_a_name_with_terminal_escapes_is_invalid_request(broker: BrokerHarness) -> None:
    channel = str(uuid.uuid4())
    owner = await broker.human_owned_agent("owner")
    cred = broker.credential(owner, [channel])
    before = {r.pubkey for r in broker.app.directory.agents(include_deleted=True)}
    for args in (
        {"channelId": channel, "displayName": HOSTILE, "systemPrompt": "p"},
        {"channelId": channel, "displayName": "Bob", "systemPrompt": "p", "model": "m\u202e"},
        {"channelId": channel, "displayName": "\x9b2JBob", "systemPrompt": "p"},
    ):
        refused = await broker.call(cred, "agents.create", args)
        assert (refused["status"], refused["error"]["code"]) == ("failed", "invalid_request")
    profile = await broker.call(cred, "profile.set", {"displayName": "\u001cBob"})
    assert (profile["status"], profile["error"]["code"]) == ("failed", "invalid_request")
    # Nothing was minted, named or published.
    assert {r.pubkey for r in broker.app.directory.agents(include_deleted=True)} == before
    records = await trio.to_thread.run_sync(
        nostr_fetch, broker.relay_url, [{"kinds": [30177], "authors": [owner]}])
    assert records == []

    # Content is published exactly as written (NIP-BA), escapes and U+001C included.
    post = await broker.call(cred, "message.post", {"channelId": channel,
                                                    "content": HOSTILE + "\u001c"})
    assert post["status"] == "succeeded", post
    [event] = await trio.to_thread.run_sync(
        nostr_fetch, broker.relay_url, [{"ids": [post["outcome"]["eventId"]]}])
    assert event["content"] == HOSTILE + "\u001c"
