"""Answers and records exactly as Buzz writes and reads them (issue 15 items 1, 2 and 4).

- The real answer of each of the nine operations, through the socket against LocalRelay,
  has exactly the members wire-schema.md names (read from ../shared/spec; when the file is
  absent, from the hand transcription the conformance tests use, which
  tests/contract/test_wire_schema.py pins to the file) and passes the contract's echo table.
- A 30177 republish keeps every member read that the host does not set (`persona_id`,
  `respond_to_allowlist`, `parallelism`, a member of a later Buzz) and carries no `runtime`;
  the members Buzz requires are there even when the record read had them empty
  (`respond_to`) or there was none (`name`).
- A reaction to an event of another channel is refused.
"""

from __future__ import annotations

import json
import uuid
import warnings
from typing import Any

import pytest
import trio

from buzzwire.contract import ACTIONS, build_request, echo_mismatch, parse_response
from tests.conformance._spec import NIP_BA_ADDED
from custody import UnsignedEvent
from tests.conformance import _spec
from tests.contract.wire_schema_md import load, skip_reason
from tests.fixtures.broker import BrokerHarness, request_body
from tests.fixtures.relay import nostr_fetch, nostr_publish


def _outcome_members() -> dict[str, frozenset[str]]:
    schema = load()
    if schema is None:
        warnings.warn(skip_reason() + "; using the conformance transcription instead", stacklevel=2)
        return _transcribed()
    # wire-schema.md pins the nine actions Buzz had when it was written; the six NIP-BA
    # added (storage.get, storage.put, ...) come from the conformance transcription.
    return {**_transcribed(), **{a: outcome for a, (_, outcome) in schema.actions.items()}}


def _transcribed() -> dict[str, frozenset[str]]:
    """agent-broker.md's nine and NIP-BA's six, as the conformance tables transcribe them."""
    tables = {**_spec.NIP_BA_OUTCOMES, **_spec.OUTCOME_MEMBERS}
    return {a: req | opt for a, (req, opt) in tables.items()}


@pytest.mark.broker_config(policy={"models": ["m"]})  # the model it names, declared
async def test_the_nine_real_answers_are_spelled_as_wire_schema_md(broker: BrokerHarness) -> None:
    channel = str(uuid.uuid4())
    owner = await broker.human_owned_agent("owner")
    cred = broker.credential(owner, [channel])
    post = await broker.call(cred, "message.post", {"channelId": channel, "content": "hi"})
    await broker.call(cred, "message.post", {"channelId": channel, "content": "more"})
    target = post["outcome"]["eventId"]
    created = await broker.call(cred, "agents.create", {
        "channelId": channel, "displayName": "Kid", "systemPrompt": "p", "runtime": "goose"})
    kid = created["outcome"]["agentPubkey"]
    calls: list[tuple[str, dict[str, Any]]] = [
        ("channel.read", {"channelId": channel, "limit": 1}),  # a second page: nextCursor too
        ("message.post", {"channelId": channel, "content": "again"}),
        ("message.reply", {"channelId": channel, "replyToEventId": target, "content": "re"}),
        ("reaction.add", {"channelId": channel, "targetEventId": target, "reaction": "+"}),
        ("profile.set", {"displayName": "Owner"}),
        ("storage.address", {"slug": "core"}),
        ("storage.put", {"slug": "core", "value": "I am the owner."}),
        ("storage.get", {"slug": "core"}),  # after the put: `value` is present
        ("agents.create", {"channelId": channel, "displayName": "Kid 2", "systemPrompt": "p"}),
        ("agents.update", {"target": {"pubkey": kid}, "model": "m"}),
        ("agents.delete", {"target": {"pubkey": kid}}),
    ]
    # wire-schema.md's nine; the actions NIP-BA added are held to NIP-BA's own table by
    # tests/conformance/test_nip_ba_vectors.py.
    assert {a for a, _ in calls} - NIP_BA_ADDED == set(ACTIONS) - NIP_BA_ADDED
    wanted = _outcome_members()
    for action, args in calls:
        body = request_body(action, args)
        status, answer = await broker.post(body, cred)
        assert status == 200 and answer is not None
        assert answer["status"] == "succeeded", (action, answer)
        assert set(answer) == set(_spec.SUCCEEDED_MEMBERS), (action, answer)
        assert set(answer["outcome"]) == wanted[action], (action, answer["outcome"])
        # The client's reading of the same bytes: strict shape, then the echo table.
        response = parse_response(json.dumps(answer).encode())
        request = json.loads(body)
        frozen = build_request(action, request["args"], request_id=request["requestId"])
        assert echo_mismatch(ACTIONS[action].echoes, frozen.args, response.outcome, owner) is None


@pytest.mark.broker_config(policy={"models": ["m-2"]})  # the model it names, declared
async def test_a_30177_republish_keeps_what_it_read_and_never_carries_runtime(
    broker: BrokerHarness,
) -> None:
    channel = str(uuid.uuid4())
    owner = await broker.human_owned_agent("owner")
    cred = broker.credential(owner, [channel])
    created = await broker.call(cred, "agents.create", {
        "channelId": channel, "displayName": "Kid", "systemPrompt": "p", "runtime": "goose"})
    kid = created["outcome"]["agentPubkey"]
    flt = {"kinds": [30177], "authors": [owner], "#d": [kid]}
    [first] = await trio.to_thread.run_sync(nostr_fetch, broker.relay_url, [flt])
    assert json.loads(first["content"]) == {
        "name": "Kid", "system_prompt": "p", "parallelism": 1, "respond_to": "owner-only"}

    # The owner edits the record elsewhere (Buzz's desktop): members this host never sets,
    # a parallelism of its own, and a runtime an older host version wrote.
    edited = {"name": "Kid", "persona_id": "persona-7", "system_prompt": "p",
              "persona_source_version": 3, "parallelism": 4, "respond_to": "allowlist",
              "respond_to_allowlist": ["c6047f9441ed7d6d3045406e95c07cd85c778e4b8cef3ca7abac09b95c709ee5"],
              "future_member": {"kept": True}, "runtime": "codex"}
    signed = await broker.custody.sign_event(owner, UnsignedEvent(
        pubkey=owner, created_at=first["created_at"] + 1, kind=30177, tags=(("d", kid),),
        content=json.dumps(edited)))
    assert await trio.to_thread.run_sync(nostr_publish, broker.relay_url,
                                         dict(signed.to_json_obj()))

    updated = await broker.call(cred, "agents.update", {"target": {"pubkey": kid}, "model": "m-2"})
    assert updated["outcome"]["updatedFields"] == ["model"], updated
    records = await trio.to_thread.run_sync(nostr_fetch, broker.relay_url, [flt])
    newest = max(records, key=lambda e: e["created_at"])
    assert newest["created_at"] > first["created_at"] + 1
    kept = {k: v for k, v in edited.items() if k != "runtime"}
    assert json.loads(newest["content"]) == {**kept, "model": "m-2"}

    # A runtime change alone is the host's record only: nothing new on the relay.
    runtime = await broker.call(cred, "agents.update", {"target": {"pubkey": kid}, "runtime": "codex"})
    assert runtime["outcome"]["updatedFields"] == ["runtime"], runtime
    assert broker.app.runtimes.get(kid) == "codex"
    again = await trio.to_thread.run_sync(nostr_fetch, broker.relay_url, [flt])
    assert max(e["created_at"] for e in again) == newest["created_at"]


@pytest.mark.parametrize("empty", ["", None], ids=["empty-string", "null"])
async def test_a_30177_read_with_an_empty_respond_to_is_republished_with_the_default(
    broker: BrokerHarness, empty: object,
) -> None:
    """Buzz reads `respond_to` as required: one read empty or null (not only absent) is
    republished as the default, "owner-only"."""
    channel = str(uuid.uuid4())
    owner = await broker.human_owned_agent("owner")
    cred = broker.credential(owner, [channel])
    created = await broker.call(cred, "agents.create", {
        "channelId": channel, "displayName": "Kid", "systemPrompt": "p"})
    kid = created["outcome"]["agentPubkey"]
    flt = {"kinds": [30177], "authors": [owner], "#d": [kid]}
    [first] = await trio.to_thread.run_sync(nostr_fetch, broker.relay_url, [flt])
    edited = {"name": "Kid", "system_prompt": "p", "parallelism": 1, "respond_to": empty}
    signed = await broker.custody.sign_event(owner, UnsignedEvent(
        pubkey=owner, created_at=first["created_at"] + 1, kind=30177, tags=(("d", kid),),
        content=json.dumps(edited)))
    assert await trio.to_thread.run_sync(nostr_publish, broker.relay_url,
                                         dict(signed.to_json_obj()))
    updated = await broker.call(cred, "agents.update",
                                {"target": {"pubkey": kid}, "systemPrompt": "q"})
    assert updated["status"] == "succeeded", updated
    records = await trio.to_thread.run_sync(nostr_fetch, broker.relay_url, [flt])
    newest = max(records, key=lambda e: e["created_at"])
    assert json.loads(newest["content"]) == {**edited, "system_prompt": "q",
                                             "respond_to": "owner-only"}


async def test_an_update_of_an_agent_with_no_30177_publishes_its_name(
    broker: BrokerHarness,
) -> None:
    """Buzz reads `name` as required: an agent the relay holds no record for (imported with
    `agent import --owner`) gets its directory name in the record its update publishes."""
    import coincurve

    channel = str(uuid.uuid4())
    owner = await broker.human_owned_agent("owner")
    cred = broker.credential(owner, [channel])
    secret = bytearray(coincurve.PrivateKey().secret.hex().encode("ascii"))
    kid = await broker.hold(secret, owner=owner, name="imported kid")
    updated = await broker.call(cred, "agents.update", {
        "target": {"pubkey": kid}, "systemPrompt": "be brief"})
    assert updated["status"] == "succeeded", updated
    assert updated["outcome"]["updatedFields"] == ["systemPrompt"]
    [record] = await trio.to_thread.run_sync(
        nostr_fetch, broker.relay_url, [{"kinds": [30177], "authors": [owner], "#d": [kid]}])
    content = json.loads(record["content"])
    assert content["name"] == "imported kid" and content["system_prompt"] == "be brief"


async def test_a_reaction_to_another_channels_event_is_refused(broker: BrokerHarness) -> None:
    mine, theirs = str(uuid.uuid4()), str(uuid.uuid4())
    other = await broker.human_owned_agent("other")
    other_cred = broker.credential(other, [theirs])
    post = await broker.call(other_cred, "message.post", {"channelId": theirs, "content": "B"})
    target = post["outcome"]["eventId"]

    agent = await broker.human_owned_agent("reactor")
    cred = broker.credential(agent, [mine])  # bound to channel A only
    refused = await broker.call(cred, "reaction.add", {
        "channelId": mine, "targetEventId": target, "reaction": "+"})
    assert (refused["status"], refused["error"]["code"]) == ("failed", "action_failed")
    missing = await broker.call(cred, "reaction.add", {
        "channelId": mine, "targetEventId": "ab" * 32, "reaction": "+"})
    assert (missing["status"], missing["error"]["code"]) == ("failed", "action_failed")
    reactions = await trio.to_thread.run_sync(
        nostr_fetch, broker.relay_url, [{"kinds": [7], "#e": [target]}])
    assert reactions == []


async def test_agents_with_untidy_names_still_get_a_buzz_shaped_answer(broker: BrokerHarness) -> None:
    """An imported agent named with padding (once a bodiless 500 on agents.delete), and a
    name too long for `displayName`, answer with a trimmed, bounded name."""
    import coincurve

    channel = str(uuid.uuid4())
    owner = await broker.human_owned_agent("owner")
    cred = broker.credential(owner, [channel])
    for name, shown in (("  Padded  ", "Padded"), ("x" * 130, "x" * 120)):
        secret = bytearray(coincurve.PrivateKey().secret.hex().encode("ascii"))
        kid = await broker.hold(secret, owner=owner, name=name)
        deleted = await broker.call(cred, "agents.delete", {"target": {"pubkey": kid}})
        assert deleted["status"] == "succeeded", deleted
        assert deleted["outcome"] == {"agentPubkey": kid, "displayName": shown}
