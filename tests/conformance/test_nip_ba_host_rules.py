"""NIP-BA's host rules that no other test sent through the real daemon and relay.

Each test names the NIP-BA sentence it holds the host to; docs/protocol.md §10 lists every
rule with its test (these and the ones elsewhere).
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import trio

from tests.conformance._wire import (
    Wire, check_envelope, envelope_body, exchange, fetch, known_agent,
)
from tests.fixtures.broker import BrokerHarness


async def test_a_revoked_credential_gets_no_stored_result_back(broker: BrokerHarness) -> None:
    # "authorize both execution and release of stored results. A revoked credential MUST
    # NOT retrieve a cached read or outcome."
    channel = str(uuid.uuid4())
    a = await known_agent(broker, "revoked", [channel])
    wire = Wire(broker)
    wire.bind(a.credential, a.pubkey)
    bodies = [envelope_body("message.post", {"channelId": channel, "content": "once"}),
              envelope_body("presence.set", {"status": "online"}),
              envelope_body("channel.read", {"channelId": channel})]
    for body in bodies:
        assert (await wire.send(body, a.credential))["status"] == "succeeded"
    [info] = [i for i in broker._sessions.list() if not i.revoked_at and i.agent == a.pubkey]
    assert broker._sessions.revoke(info.credential_id)
    for body in bodies:
        answer = await wire.send(body, a.credential)
        assert answer["status"] == "failed" and answer["error"]["code"] == "unauthenticated"
        assert "outcome" not in answer and "replayed" not in answer


async def test_concurrent_duplicates_are_joined_or_indeterminate_never_run_twice(
        broker: BrokerHarness) -> None:
    # "For a matching in-flight record, the host MUST join/wait within its timeout or
    # return indeterminate/outcome_unknown; it MUST NOT start another executor."
    channel = str(uuid.uuid4())
    a = await known_agent(broker, "twins", [channel])
    wire = Wire(broker)
    wire.bind(a.credential, a.pubkey)
    body = envelope_body("message.post", {"channelId": channel, "content": "exactly once"})
    answers: list[dict[str, Any]] = []

    headers = [("Content-Type", "application/json"), ("Authorization", f"Bearer {a.credential}")]

    async def send() -> None:
        # Sent at once, so none of them is knowably the first: each answer is checked
        # like any other (NIP-BA's result rules included), replayed allowed.
        reply = await exchange(broker.socket, "POST", "/v1/action", body, headers)
        answers.append(check_envelope(body, reply, first_sending=False, me=a.pubkey))

    async with trio.open_nursery() as nursery:
        for _ in range(8):
            nursery.start_soon(send)
    done = [x for x in answers if x["status"] == "succeeded"]
    assert done, answers
    for answer in answers:
        assert answer["status"] in ("succeeded", "indeterminate"), answer
        if answer["status"] == "indeterminate":
            assert answer["error"]["code"] == "outcome_unknown", answer
    assert len({x["outcome"]["eventId"] for x in done}) == 1
    assert sum("replayed" not in x for x in done) <= 1  # one executor; the rest joined
    posted = await fetch(broker, {"kinds": [9], "authors": [a.pubkey]})
    assert [e["id"] for e in posted] == [done[0]["outcome"]["eventId"]]


@pytest.mark.broker_config(policy={"providers": ["p"], "models": ["m1", "m2"]})  # declared
async def test_updated_fields_sorted_unique_supplied_and_empty_for_a_no_op(
        broker: BrokerHarness) -> None:
    # "updatedFields lists actually changed wire names in lexicographic order without
    # duplicates; it is empty for an idempotent no-op patch and MUST be a subset of
    # supplied mutable fields."
    channel = str(uuid.uuid4())
    a = await known_agent(broker, "parent", [channel])
    wire = Wire(broker)
    made = await wire.ok(a, "agents.create", {"channelId": channel, "displayName": "Kid",
                                               "systemPrompt": "one", "model": "m1"})
    target = {"pubkey": made["agentPubkey"]}
    rows: list[tuple[dict[str, Any], list[str]]] = [
        # (patch, updatedFields) — sent in this order, each against the state before it
        ({"systemPrompt": "two", "model": "m2", "displayName": "Kid"}, ["model", "systemPrompt"]),
        ({"systemPrompt": "two", "model": "m2"}, []),  # a no-op patch
        ({"respondTo": "anyone", "displayName": "Kid 2", "provider": "p"},
         ["displayName", "provider", "respondTo"]),
        ({"respondTo": " anyone "}, []),  # trimmed to the value it already has
    ]
    for patch, fields in rows:
        out = await wire.ok(a, "agents.update", {"target": target, **patch})
        assert out["updatedFields"] == fields, (patch, out)


@pytest.mark.broker_config(policy={"models": ["m"]})  # the model it names, declared
async def test_missing_and_ambiguous_name_targets_are_refused(broker: BrokerHarness) -> None:
    # "The host resolves names within authorized ownership scope and MUST reject missing
    # or ambiguous matches, never choose an arbitrary agent."
    channel = str(uuid.uuid4())
    a = await known_agent(broker, "owner", [channel])
    b = await known_agent(broker, "stranger", [channel])
    wire = Wire(broker)
    for _ in range(2):
        await wire.ok(a, "agents.create", {"channelId": channel, "displayName": "Twin",
                                           "systemPrompt": "p"})
    await wire.ok(b, "agents.create", {"channelId": channel, "displayName": "Solo",
                                       "systemPrompt": "p"})
    for action, extra in (("agents.update", {"model": "m"}), ("agents.delete", {})):
        for who, name in ((a, "Twin"), (a, "Nobody"), (a, "Solo")):
            answer = await wire.call(who, action, {"target": {"name": name}, **extra})
            assert answer["status"] == "failed" and answer["error"]["code"] == "action_failed", (
                action, name, answer)
    # Both twins are untouched: nothing was chosen arbitrarily.
    kids = [r for r in broker.app.directory.agents() if r.owner == a.pubkey]
    assert sorted(r.name for r in kids) == ["Twin", "Twin"]
