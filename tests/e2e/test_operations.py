"""Every operation through the Unix socket against LocalRelay (NIP-42 AUTH required), then an
independent read of the relay with nostr-sdk's own client checking kinds, tags, authors, `auth`
tags and signatures (issue 5, "Tests").
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest
import trio

from custody import UnsignedEvent, verify_owner_tag
from tests.conformance._wire import owner_tag
from tests.fixtures.broker import BrokerHarness, request_body
from tests.fixtures.relay import TestKey, nostr_fetch, nostr_publish, nostr_verify


def _fetch(harness: BrokerHarness, flt: dict[str, Any]) -> Any:
    return trio.to_thread.run_sync(nostr_fetch, harness.relay_url, [flt])


def _succeeded(envelope: dict[str, Any], action: str) -> dict[str, Any]:
    assert envelope["status"] == "succeeded", envelope
    assert envelope["action"] == action
    return dict(envelope["outcome"])


async def _agent_in(broker: BrokerHarness, channel: str, name: str = "agent") -> tuple[str, str]:
    agent = await broker.human_owned_agent(name)
    return agent, broker.credential(agent, [channel])


async def test_post_reply_and_read_the_thread_back(broker: BrokerHarness) -> None:
    channel = str(uuid.uuid4())
    agent, cred = await _agent_in(broker, channel)
    other = "c6047f9441ed7d6d3045406e95c07cd85c778e4b8cef3ca7abac09b95c709ee5"

    post = _succeeded(await broker.call(cred, "message.post", {
        "channelId": channel.upper(), "content": "hello 👋 \"world\" \\ 世界",
        "mentions": [other.upper(), other]}), "message.post")
    reply = _succeeded(await broker.call(cred, "message.reply", {
        "channelId": channel, "replyToEventId": post["eventId"], "content": "first reply"}),
        "message.reply")
    nested = _succeeded(await broker.call(cred, "message.reply", {
        "channelId": channel, "replyToEventId": reply["eventId"], "content": "nested"}),
        "message.reply")

    events = {e["id"]: e for e in await _fetch(broker, {"kinds": [9], "#h": [channel]})}
    assert set(events) == {post["eventId"], reply["eventId"], nested["eventId"]}
    for event in events.values():
        assert nostr_verify(event)
        assert event["pubkey"] == agent and event["kind"] == 9
    top = events[post["eventId"]]
    assert top["content"] == "hello 👋 \"world\" \\ 世界"
    assert top["tags"] == [["h", channel], ["p", other]]
    assert events[reply["eventId"]]["tags"] == [["h", channel], ["e", post["eventId"], "", "reply"]]
    assert events[nested["eventId"]]["tags"] == [
        ["h", channel], ["e", post["eventId"], "", "root"], ["e", reply["eventId"], "", "reply"]]

    page = _succeeded(await broker.call(cred, "channel.read", {
        "channelId": channel, "rootEventId": post["eventId"]}), "channel.read")
    ids = [m["id"] for m in page["messages"]]
    assert reply["eventId"] in ids and nested["eventId"] in ids
    assert "nextCursor" not in page
    for message in page["messages"]:
        assert set(message) == {"id", "pubkey", "created_at", "kind", "tags", "content", "sig"}
        assert nostr_verify(message)


async def test_reply_to_missing_or_foreign_parent_fails(broker: BrokerHarness) -> None:
    channel, elsewhere = str(uuid.uuid4()), str(uuid.uuid4())
    agent = await broker.human_owned_agent()
    cred = broker.credential(agent, [channel, elsewhere])
    missing = await broker.call(cred, "message.reply", {
        "channelId": channel, "replyToEventId": "ab" * 32, "content": "x"})
    assert (missing["status"], missing["error"]["code"]) == ("failed", "action_failed")
    post = _succeeded(await broker.call(cred, "message.post", {
        "channelId": elsewhere, "content": "over there"}), "message.post")
    foreign = await broker.call(cred, "message.reply", {
        "channelId": channel, "replyToEventId": post["eventId"], "content": "x"})
    assert (foreign["status"], foreign["error"]["code"]) == ("failed", "action_failed")


async def _publish_as(broker: BrokerHarness, author: str, tags: list[list[str]]) -> str:
    """A kind 9 signed in custody by `author` and put on the relay as another client would."""
    signed = await broker.custody.sign_event(author, UnsignedEvent(
        pubkey=author, created_at=int(time.time()), kind=9,
        tags=tuple(tuple(t) for t in tags), content="written elsewhere"))
    assert await trio.to_thread.run_sync(nostr_publish, broker.relay_url,
                                         dict(signed.to_json_obj()))
    return signed.id


async def test_a_reply_needs_the_parents_real_root_in_the_channel(broker: BrokerHarness) -> None:
    # NIP-BA: the host derives the parent's actual root; missing, elsewhere, unreadable
    # or inconsistent ancestry fails before publication, on a relay that filters by id.
    channel, elsewhere = str(uuid.uuid4()), str(uuid.uuid4())
    agent = await broker.human_owned_agent()
    cred = broker.credential(agent, [channel, elsewhere])
    root = _succeeded(await broker.call(cred, "message.post", {
        "channelId": channel, "content": "root"}), "message.post")["eventId"]
    foreign = _succeeded(await broker.call(cred, "message.post", {
        "channelId": elsewhere, "content": "over there"}), "message.post")["eventId"]
    parents = {
        "names a root no event has": [["h", channel], ["e", "ab" * 32, "", "root"]],
        "names a root in another channel": [["h", channel], ["e", foreign, "", "root"]],
        "threads positionally": [["h", channel], ["e", root]],
        "names two roots": [["h", channel], ["e", root, "", "root"], ["e", foreign, "", "root"]],
        "is in two channels": [["h", elsewhere], ["h", channel], ["e", root, "", "reply"]],
    }
    refused = []
    for why, tags in parents.items():
        parent = await _publish_as(broker, agent, tags)
        refused.append(parent)
        answer = await broker.call(cred, "message.reply", {
            "channelId": channel, "replyToEventId": parent, "content": "x"})
        assert (answer["status"], answer["error"]["code"]) == ("failed", "action_failed"), why
    # Control: the same relay, a parent written elsewhere naming the real root.
    parent = await _publish_as(broker, agent, [["h", channel], ["e", root, "", "reply"]])
    reply = _succeeded(await broker.call(cred, "message.reply", {
        "channelId": channel, "replyToEventId": parent, "content": "x"}), "message.reply")
    [event] = await _fetch(broker, {"ids": [reply["eventId"]]})
    assert event["tags"] == [["h", channel], ["e", root, "", "root"], ["e", parent, "", "reply"]]
    mine = await _fetch(broker, {"kinds": [9], "#h": [channel], "authors": [agent]})
    assert {e["id"] for e in mine} == {root, parent, reply["eventId"], *refused}, (
        "a refused reply reached the relay")


async def test_a_reply_or_reaction_builds_only_on_a_channel_message(
        broker: BrokerHarness) -> None:
    """NIP-BA reuses NIP-10's marked root/reply "for Buzz kind 9": a parent, a derived
    root and a reaction target must be kinds channel.read returns. An outside key's
    NIP-29 moderation event (9000) and app record (30078), both carrying the channel's
    `h` tag, are refused as each, `action_failed`, and nothing reaches the relay; before
    the fix each was built on, rooting a thread no read of the channel shows."""
    channel = str(uuid.uuid4())
    agent, cred = await _agent_in(broker, channel)
    outsider = TestKey()

    async def outside(kind: int, tags: list[list[str]]) -> str:
        event = outsider.sign(kind, "written elsewhere", tags)
        assert await trio.to_thread.run_sync(nostr_publish, broker.relay_url, event,
                                             outsider.secret_hex)
        return str(event["id"])

    not_messages = {
        "a NIP-29 put-user": await outside(9000, [["h", channel], ["p", agent]]),
        "an app record": await outside(30078, [["h", channel], ["d", "x"]]),
    }
    naming: list[str] = []
    answered: dict[str, tuple[str, str | None]] = {}
    for why, other in not_messages.items():
        # A kind 9 whose tags name it as the thread root: the derived root is refused too.
        naming.append(await _publish_as(broker, agent, [["h", channel],
                                                        ["e", other, "", "root"]]))
        attempts = {
            "as parent": ("message.reply", {"channelId": channel, "replyToEventId": other,
                                            "content": "x"}),
            "as root": ("message.reply", {"channelId": channel, "replyToEventId": naming[-1],
                                          "content": "x"}),
            "as target": ("reaction.add", {"channelId": channel, "targetEventId": other,
                                           "reaction": "+"}),
        }
        for how, (action, args) in attempts.items():
            answer = await broker.call(cred, action, args)
            answered[f"{why} {how}"] = (answer["status"], answer.get("error", {}).get("code"))
    assert answered == {attempt: ("failed", "action_failed") for attempt in answered}, answered
    # Control: the same outside key's kind 9 in the channel is built on, both ways.
    message = await outside(9, [["h", channel]])
    reply = _succeeded(await broker.call(cred, "message.reply", {
        "channelId": channel, "replyToEventId": message, "content": "x"}), "message.reply")
    reaction = _succeeded(await broker.call(cred, "reaction.add", {
        "channelId": channel, "targetEventId": message, "reaction": "+"}), "reaction.add")
    mine = await _fetch(broker, {"authors": [agent]})
    assert {e["id"] for e in mine} == {*naming, reply["eventId"], reaction["eventId"]}, (
        "a refused reply or reaction reached the relay")


async def test_reaction_and_profile(broker: BrokerHarness) -> None:
    channel = str(uuid.uuid4())
    agent, cred = await _agent_in(broker, channel)
    post = _succeeded(await broker.call(cred, "message.post", {
        "channelId": channel, "content": "react to me"}), "message.post")
    reaction = _succeeded(await broker.call(cred, "reaction.add", {
        "channelId": channel, "targetEventId": post["eventId"], "reaction": "👍"}),
        "reaction.add")
    assert reaction["kind"] == 7

    first = _succeeded(await broker.call(cred, "profile.set", {
        "displayName": "Scout", "about": "I find things"}), "profile.set")
    second = _succeeded(await broker.call(cred, "profile.set", {"picture": "https://x.test/a.png"}),
                        "profile.set")
    assert second["createdAt"] > first["createdAt"] or second["createdAt"] >= first["createdAt"] + 1
    profiles = await _fetch(broker, {"kinds": [0], "authors": [agent]})
    newest = max(profiles, key=lambda e: e["created_at"])
    assert newest["id"] == second["eventId"] and nostr_verify(newest)
    assert json.loads(newest["content"]) == {
        "display_name": "Scout", "name": "Scout", "about": "I find things",
        "picture": "https://x.test/a.png"}
    reactions = await _fetch(broker, {"kinds": [7], "#e": [post["eventId"]]})
    assert [r["content"] for r in reactions] == ["👍"]


async def test_a_corrupt_profile_is_replaced_by_a_strictly_later_version(
        broker: BrokerHarness) -> None:
    """A current kind 0 whose content is no JSON object is replaced, and the new version is
    still dated after it: a relay keeps the newer replaceable event, so a replacement dated
    before the corrupt one would be dropped and the corrupt profile kept."""
    agent, cred = await _agent_in(broker, str(uuid.uuid4()), "corrupted")
    ahead = int(time.time()) + 60  # written by the agent's runtime, its clock a minute fast
    corrupt = await broker.custody.sign_event(agent, UnsignedEvent(
        pubkey=agent, created_at=ahead, kind=0, tags=(), content="not a JSON object"))
    assert await trio.to_thread.run_sync(nostr_publish, broker.relay_url,
                                         dict(corrupt.to_json_obj()))
    answer = _succeeded(await broker.call(cred, "profile.set", {"displayName": "Ada"}),
                        "profile.set")
    assert answer["createdAt"] == ahead + 1
    [kept] = await _fetch(broker, {"kinds": [0], "authors": [agent]})
    assert kept["id"] == answer["eventId"]
    assert json.loads(kept["content"]) == {"display_name": "Ada", "name": "Ada"}


async def test_storage_address_matches_the_nip_ae_vector(broker: BrokerHarness) -> None:
    owner = "c6047f9441ed7d6d3045406e95c07cd85c778e4b8cef3ca7abac09b95c709ee5"
    secret = bytearray(b"00" * 31 + b"01")
    record = await broker.custody.import_agent(secret, owner=owner)
    cred = broker.credential(record.pubkey, [str(uuid.uuid4())])
    outcome = _succeeded(await broker.call(cred, "storage.address", {"slug": "mem/example"}),
                         "storage.address")
    assert outcome == {
        "authorPubkey": "79be667ef9dcbbac55a06295ce870b07029bfcdb2dce28d959f2815b16f81798",
        "kind": 30174,
        "dTag": "72d4f9629106451505d7d341ea85bb3ebad4f654fcfd2aad100d5a35f8a85cba",
    }


@pytest.mark.broker_config(policy={"models": ["m-1"]})  # the model it names, declared
async def test_agents_create_update_delete(broker: BrokerHarness) -> None:
    channel = str(uuid.uuid4())
    owner, cred = await _agent_in(broker, channel, "owner")
    created = _succeeded(await broker.call(cred, "agents.create", {
        "channelId": channel, "displayName": "Helper", "systemPrompt": "be brief",
        "runtime": "goose"}), "agents.create")
    assert set(created) == {"agentPubkey", "displayName", "channelId"}
    agent = created["agentPubkey"]
    assert created["channelId"] == channel

    put_user = await _fetch(broker, {"kinds": [9000], "#p": [agent]})
    assert len(put_user) == 1 and put_user[0]["pubkey"] == owner
    assert put_user[0]["tags"] == [["h", channel], ["p", agent], ["role", "bot"]]
    records = await _fetch(broker, {"kinds": [30177], "authors": [owner], "#d": [agent]})
    assert len(records) == 1 and nostr_verify(records[0])
    assert json.loads(records[0]["content"]) == {
        "name": "Helper", "system_prompt": "be brief", "parallelism": 1,
        "respond_to": "owner-only"}
    # The runtime is the host's own record, never the world-readable 30177.
    assert broker.app.runtimes.get(agent) == "goose"
    profiles = await _fetch(broker, {"kinds": [0], "authors": [agent]})
    assert len(profiles) == 1 and nostr_verify(profiles[0])
    auth_tags = [t for t in profiles[0]["tags"] if t[0] == "auth"]
    assert len(auth_tags) == 1 and auth_tags[0][1] == owner
    assert verify_owner_tag(auth_tags[0], agent)

    # The created agent's own events carry its owner tag exactly once.
    agent_cred = broker.credential(agent, [channel])
    post = _succeeded(await broker.call(agent_cred, "message.post", {
        "channelId": channel, "content": "hi from the helper"}), "message.post")
    [event] = await _fetch(broker, {"ids": [post["eventId"]]})
    assert [t[0] for t in event["tags"]].count("auth") == 1

    updated = _succeeded(await broker.call(cred, "agents.update", {
        "target": {"name": "Helper"}, "displayName": "Helper 2", "systemPrompt": "be brief",
        "model": "m-1"}), "agents.update")
    assert updated == {"agentPubkey": agent, "displayName": "Helper 2",
                       "updatedFields": ["displayName", "model"]}
    assert broker.app.directory.agent(agent).name == "Helper 2"
    records = await _fetch(broker, {"kinds": [30177], "authors": [owner], "#d": [agent]})
    newest = max(records, key=lambda e: e["created_at"])
    assert json.loads(newest["content"])["name"] == "Helper 2"

    deleted = _succeeded(await broker.call(cred, "agents.delete", {"target": {"pubkey": agent}}),
                         "agents.delete")
    assert deleted == {"agentPubkey": agent, "displayName": "Helper 2"}
    deletions = await _fetch(broker, {"kinds": [5], "authors": [owner]})
    assert deletions[0]["tags"] == [["a", f"30177:{owner}:{agent}"], ["k", "30177"]]
    # The deleted agent's key is gone and its credentials stop working.
    assert broker.custody.agent(agent) is None
    after = await broker.call(agent_cred, "message.post", {"channelId": channel, "content": "x"})
    assert (after["status"], after["error"]["code"]) == ("failed", "unauthenticated")


async def test_a_created_agent_names_its_creator(broker: BrokerHarness) -> None:
    """The directory records who created the agent (`creator`, listed by `agent list` and
    carried by `keys backup`), not only its owner."""
    channel = str(uuid.uuid4())
    owner, cred = await _agent_in(broker, channel, "parent")
    made = _succeeded(await broker.call(cred, "agents.create", {
        "channelId": channel, "displayName": "kid", "systemPrompt": "p"}), "agents.create")
    kid = broker.app.directory.agent(made["agentPubkey"])
    assert kid is not None and kid.owner == owner and kid.creator == owner
    assert kid.to_json_obj()["creator"] == owner


async def test_a_runtime_changed_with_a_record_member_is_recorded(broker: BrokerHarness) -> None:
    """With a 30177 change the runtime is a commit step (run once the relay took the
    record), not written at once as when it changes alone: both must land."""
    channel = str(uuid.uuid4())
    _owner, cred = await _agent_in(broker, channel, "owner")
    made = _succeeded(await broker.call(cred, "agents.create", {
        "channelId": channel, "displayName": "kid", "systemPrompt": "p", "runtime": "goose"}),
        "agents.create")
    kid = made["agentPubkey"]
    updated = _succeeded(await broker.call(cred, "agents.update", {
        "target": {"pubkey": kid}, "displayName": "kid 2", "runtime": "codex"}), "agents.update")
    assert updated["updatedFields"] == ["displayName", "runtime"]
    assert broker.app.runtimes.get(kid) == "codex"
    assert broker.app.directory.agent(kid).name == "kid 2"


async def test_agents_policy_refusals(broker: BrokerHarness) -> None:
    channel = str(uuid.uuid4())
    owner, cred = await _agent_in(broker, channel, "owner")
    unknown_runtime = await broker.call(cred, "agents.create", {
        "channelId": channel, "displayName": "X", "systemPrompt": "p", "runtime": "nope"})
    assert (unknown_runtime["status"], unknown_runtime["error"]["code"]) == (
        "failed", "invalid_request")
    # Depth: a human-owned agent is depth 1; the default cap is 3.
    depth2 = _succeeded(await broker.call(cred, "agents.create", {
        "channelId": channel, "displayName": "D2", "systemPrompt": "p"}), "agents.create")
    cred2 = broker.credential(depth2["agentPubkey"], [channel])
    depth3 = _succeeded(await broker.call(cred2, "agents.create", {
        "channelId": channel, "displayName": "D3", "systemPrompt": "p"}), "agents.create")
    cred3 = broker.credential(depth3["agentPubkey"], [channel])
    too_deep = await broker.call(cred3, "agents.create", {
        "channelId": channel, "displayName": "D4", "systemPrompt": "p"})
    assert (too_deep["status"], too_deep["error"]["code"]) == ("failed", "unauthorized")
    assert "3" in too_deep["error"]["message"]
    # Another owner's agent cannot be touched.
    stranger, stranger_cred = await _agent_in(broker, channel, "stranger")
    foreign = await broker.call(stranger_cred, "agents.delete", {
        "target": {"pubkey": depth2["agentPubkey"]}})
    assert (foreign["status"], foreign["error"]["code"]) == ("failed", "unauthorized")


#: nostr-sdk LocalRelay's default cap on one event's JSON, the test relay's: an event of
#: this many bytes is stored, one byte more is refused "event size ... exceeds".
RELAY_EVENT_BYTES = 65_536
#: What a kind-9 event adds to its content's JSON (docs/protocol.md message.post): 386 bytes
#: (id, pubkey, signature, a 10-digit created_at, kind, the `h` tag, the member names), 73
#: a mention, 84 a reply's `e` tag (167 for a nested reply's two), 210 the owner's NIP-OA
#: `auth` tag.
POST_OVERHEAD = {"post": 386, "post with a mention": 386 + 73, "reply": 386 + 84,
                 "nested reply": 386 + 167, "post of an agent with an auth tag": 386 + 210}


@pytest.mark.parametrize("shape", list(POST_OVERHEAD))
async def test_the_largest_content_a_64_kib_relay_takes(broker: BrokerHarness,
                                                        shape: str) -> None:
    """The contract allows 65,536 bytes of content; the relay judges the whole signed
    event. Content of exactly RELAY_EVENT_BYTES - overhead is published (the stored event
    is RELAY_EVENT_BYTES of JSON), one byte more is `action_failed` with the relay's size
    reason and nothing is published: the figures protocol.md gives an agent splitting text."""
    channel = str(uuid.uuid4())
    if shape == "post of an agent with an auth tag":
        owner, key = TestKey(), TestKey()
        agent = await broker.hold(bytearray(key.secret_hex.encode("ascii")), owner=owner.pubkey,
                                  name="tagged", auth_tag=owner_tag(owner, key.pubkey))
        cred = broker.credential(agent, [channel])
    else:
        agent, cred = await _agent_in(broker, channel)
    args: dict[str, Any] = {"channelId": channel}
    action = "message.post"
    if shape == "post with a mention":
        args["mentions"] = [TestKey().pubkey]
    if shape in ("reply", "nested reply"):
        action = "message.reply"
        root = _succeeded(await broker.call(cred, "message.post",
                                            {"channelId": channel, "content": "root"}),
                          "message.post")
        args["replyToEventId"] = root["eventId"]
        if shape == "nested reply":
            args["replyToEventId"] = _succeeded(await broker.call(cred, "message.reply", {
                **args, "content": "first"}), "message.reply")["eventId"]
    largest = RELAY_EVENT_BYTES - POST_OVERHEAD[shape]
    fits = _succeeded(await broker.call(cred, action, {**args, "content": "x" * largest}), action)
    [event] = await _fetch(broker, {"ids": [fits["eventId"]]})
    assert len(json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode()) \
        == RELAY_EVENT_BYTES
    over = await broker.call(cred, action, {**args, "content": "x" * (largest + 1)})
    assert (over["status"], over["error"]["code"]) == ("failed", "action_failed"), over
    assert "size" in over["error"]["message"]
    published = await _fetch(broker, {"kinds": [9], "#h": [channel]})
    assert all(len(e["content"]) <= largest for e in published)


async def test_order_of_judgement_and_replay(broker: BrokerHarness) -> None:
    channel = str(uuid.uuid4())
    agent, cred = await _agent_in(broker, channel)
    # Uncorrelatable: HTTP 400, no envelope.
    status, envelope = await broker.post(b'{"requestId":', cred)
    assert (status, envelope) == (400, None)
    # No credential: unauthenticated, even for an invalid body.
    bad = request_body("message.post", {"channelId": channel, "content": ""})
    status, envelope = await broker.post(bad, None)
    assert status == 200 and envelope["error"]["code"] == "unauthenticated"
    status, envelope = await broker.post(bad, cred)
    assert envelope["error"]["code"] == "invalid_request"
    # Outside the credential's channel: unauthorized.
    outside = await broker.call(cred, "message.post", {"channelId": str(uuid.uuid4()),
                                                       "content": "x"})
    assert outside["error"]["code"] == "unauthorized"
    # The same bytes twice: the second is the first verdict, replayed.
    body = request_body("message.post", {"channelId": channel, "content": "once"})
    _, first = await broker.post(body, cred)
    _, second = await broker.post(body, cred)
    assert first["status"] == "succeeded" and "replayed" not in first
    assert second == {**first, "replayed": True}
    # One byte changed under the same requestId: a conflict; the original still replays.
    changed = body.replace(b'"once"', b'"twice"')
    _, conflict = await broker.post(changed, cred)
    assert (conflict["status"], conflict["error"]["code"]) == ("failed", "request_id_conflict")
    _, third = await broker.post(body, cred)
    assert third == second
    events = await _fetch(broker, {"kinds": [9], "#h": [channel]})
    assert [e["content"] for e in events] == ["once"]


async def test_credential_revoked_by_the_cli_stops_working_at_once(broker: BrokerHarness) -> None:
    import os
    import subprocess
    import sys

    channel = str(uuid.uuid4())
    agent = await broker.human_owned_agent()
    cred = broker.credential(agent, [channel])
    ok = await broker.call(cred, "message.post", {"channelId": channel, "content": "before"})
    assert ok["status"] == "succeeded"
    listed = subprocess.run(
        [sys.executable, "-m", "daemon.cli", "--config", str(broker.config_path),
         "credential", "list", "--json"], capture_output=True, text=True, check=True,
        env=dict(os.environ))
    entries = [json.loads(line) for line in listed.stdout.splitlines()]
    [entry] = [c for c in entries if c["agent"] == agent]
    subprocess.run(
        [sys.executable, "-m", "daemon.cli", "--config", str(broker.config_path),
         "credential", "revoke", entry["id"]], capture_output=True, check=True,
        env=dict(os.environ))
    after = await broker.call(cred, "message.post", {"channelId": channel, "content": "after"})
    assert (after["status"], after["error"]["code"]) == ("failed", "unauthenticated")
    assert cred not in listed.stdout


async def test_renaming_an_agent_waits_for_that_agents_own_profile_write(
    broker: BrokerHarness,
) -> None:
    """agents.update rewrites its target's kind 0, which the target's own profile.set merges
    into too: the rename holds the target's lock, so neither can lose the other's change."""
    channel = str(uuid.uuid4())
    owner, cred = await _agent_in(broker, channel, "owner")
    created = _succeeded(await broker.call(cred, "agents.create", {
        "channelId": channel, "displayName": "Before", "systemPrompt": "p"}), "agents.create")
    agent = created["agentPubkey"]
    done = trio.Event()

    async def rename() -> None:
        _succeeded(await broker.call(cred, "agents.update", {
            "target": {"pubkey": agent}, "displayName": "After"}), "agents.update")
        done.set()

    async with trio.open_nursery() as nursery:
        async with broker.app._locks.hold(agent):  # the agent's own profile.set, in flight
            nursery.start_soon(rename)
            await trio.sleep(0.5)
            assert not done.is_set()  # the rename waits for the agent's write to finish
        with trio.fail_after(10):
            await done.wait()
    profiles = await _fetch(broker, {"kinds": [0], "authors": [agent]})
    newest = max(profiles, key=lambda e: e["created_at"])
    assert json.loads(newest["content"])["display_name"] == "After"


async def test_a_reply_and_a_reaction_build_on_a_kind_40002_message(
        broker: BrokerHarness) -> None:
    """Every kind channel.read returns (`READ_KINDS`: 9 and 40002) may be replied to and
    reacted to: the kind check refuses what a read never shows, not Buzz's second form of
    a channel message."""
    channel = str(uuid.uuid4())
    agent, cred = await _agent_in(broker, channel)
    author = TestKey()
    event = author.sign(40002, "a message in Buzz's second form", [["h", channel]])
    assert await trio.to_thread.run_sync(nostr_publish, broker.relay_url, event,
                                         author.secret_hex)
    read = _succeeded(await broker.call(cred, "channel.read", {"channelId": channel}),
                      "channel.read")
    assert [m["id"] for m in read["messages"]] == [event["id"]]
    reply = _succeeded(await broker.call(cred, "message.reply", {
        "channelId": channel, "replyToEventId": event["id"], "content": "x"}), "message.reply")
    reaction = _succeeded(await broker.call(cred, "reaction.add", {
        "channelId": channel, "targetEventId": event["id"], "reaction": "+"}), "reaction.add")
    mine = await _fetch(broker, {"authors": [agent]})
    assert {e["id"] for e in mine} == {reply["eventId"], reaction["eventId"]}
