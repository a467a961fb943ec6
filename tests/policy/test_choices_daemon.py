"""NIP-BA "Managed agents" through the real daemon and relay: runtime, provider and model are
host-declared (`[policy] runtimes`, `providers`, `models`), and an unknown choice MUST be
refused, not silently substituted. Refused means `failed` + `invalid_request` before anything
happens: no key minted, no owner-signed kind 30177 record carrying the choice. A declared
choice goes through to that record."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import trio

from tests.fixtures.broker import BrokerHarness
from tests.fixtures.relay import nostr_fetch

pytestmark = pytest.mark.broker_config(
    policy={"runtimes": ["goose"], "providers": ["acme"], "models": ["m-1", "m-2"]})

#: (arguments naming one unknown choice among declared ones, the refusal's message).
UNKNOWN: list[tuple[dict[str, str], str]] = [
    ({"provider": "no-such-provider"}, "provider is not offered by this host"),
    ({"model": "no-such-model"}, "model is not offered by this host"),
    ({"provider": "acme", "model": "M-1"}, "model is not offered by this host"),  # exact
    ({"runtime": "goose", "provider": "Acme"}, "provider is not offered by this host"),
    ({"runtime": "skynet", "model": "m-1"}, "runtime is not offered by this host"),
]


async def _records(broker: BrokerHarness, owner: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = await trio.to_thread.run_sync(
        nostr_fetch, broker.relay_url, [{"kinds": [30177], "authors": [owner]}])
    return found


def _refused(answer: dict[str, Any], message: str) -> bool:
    return answer["status"] == "failed" and answer["error"] == {
        "code": "invalid_request", "message": message}


async def test_create_refuses_an_unknown_provider_or_model(broker: BrokerHarness) -> None:
    channel = str(uuid.uuid4())
    owner = await broker.human_owned_agent("owner")
    cred = broker.credential(owner, [channel])
    base = {"channelId": channel, "displayName": "Kid", "systemPrompt": "p"}
    held = {r.pubkey for r in broker.app.directory.agents(include_deleted=True)}
    for extra, message in UNKNOWN:
        answer = await broker.call(cred, "agents.create", {**base, **extra})
        assert _refused(answer, message), (extra, answer)
    assert {r.pubkey for r in broker.app.directory.agents(include_deleted=True)} == held
    assert await _records(broker, owner) == []

    created = await broker.call(cred, "agents.create",
                                {**base, "runtime": "goose", "provider": "acme", "model": "m-1"})
    assert created["status"] == "succeeded", created
    [record] = await _records(broker, owner)
    content = json.loads(record["content"])
    assert (content["provider"], content["model"]) == ("acme", "m-1")


async def test_update_refuses_an_unknown_provider_or_model(broker: BrokerHarness) -> None:
    channel = str(uuid.uuid4())
    owner = await broker.human_owned_agent("owner")
    cred = broker.credential(owner, [channel])
    created = await broker.call(cred, "agents.create", {
        "channelId": channel, "displayName": "Kid", "systemPrompt": "p", "model": "m-1"})
    assert created["status"] == "succeeded", created
    target = {"pubkey": created["outcome"]["agentPubkey"]}
    [before] = await _records(broker, owner)
    for extra, message in UNKNOWN:
        answer = await broker.call(cred, "agents.update", {"target": target, **extra})
        assert _refused(answer, message), (extra, answer)
    assert await _records(broker, owner) == [before]  # nothing re-signed

    updated = await broker.call(cred, "agents.update",
                                {"target": target, "provider": "acme", "model": "m-2"})
    assert updated["status"] == "succeeded", updated
    assert updated["outcome"]["updatedFields"] == ["model", "provider"]
    [after] = await _records(broker, owner)
    content = json.loads(after["content"])
    assert (content["provider"], content["model"]) == ("acme", "m-2")


@pytest.mark.broker_config()  # the built-in [policy]: no provider and no model declared
async def test_by_default_no_provider_or_model_is_offered(broker: BrokerHarness) -> None:
    channel = str(uuid.uuid4())
    owner = await broker.human_owned_agent("owner")
    cred = broker.credential(owner, [channel])
    base = {"channelId": channel, "displayName": "Kid", "systemPrompt": "p"}
    for arg in ("provider", "model"):
        answer = await broker.call(cred, "agents.create", {**base, arg: "anything"})
        assert _refused(answer, f"{arg} is not offered by this host"), answer
    # Choosing none, or a runtime the defaults offer, is what a Buzz client sends: accepted.
    assert (await broker.call(cred, "agents.create", base))["status"] == "succeeded"
    assert (await broker.call(cred, "agents.create", {**base, "displayName": "Kid 2",
                                                      "runtime": "goose"}))["status"] \
        == "succeeded"
