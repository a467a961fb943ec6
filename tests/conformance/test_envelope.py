"""[C2] host conformance, bullet by bullet, over the real socket; and the HTTP binding.

One table drives the envelope rules: (request mutation -> the code the spec names). Every
row is sent with a valid credential, must come back HTTP 200 as `failed` with that code
(the recorder in `_wire` checks the envelope itself), must replay byte-identically with
`replayed: true` when resent, and together they must leave nothing on the relay
("failed promises that no side effects took hold").
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from tests.conformance import _spec
from tests.conformance._wire import (
    DROP, Wire, envelope_body, exchange, fetch, known_agent,
)
from tests.fixtures.broker import BrokerHarness

#: The actions that leave no ledger record once they ran (issue 24).
READS = frozenset({"channel.read", "storage.address", "storage.get"})
PK = "c6047f9441ed7d6d3045406e95c07cd85c778e4b8cef3ca7abac09b95c709ee5"
EV = "ab" * 32

Build = Callable[[str], bytes]


def _post(channel: str, **override: Any) -> bytes:
    return envelope_body("message.post", {"channelId": channel, "content": "never published"},
                         **override)


def _args(action: str, args: dict[str, Any]) -> Build:
    return lambda channel: envelope_body(action, {k: (channel if v is CHANNEL else v)
                                                  for k, v in args.items()})


def _raw(template: str) -> Build:
    """A hand-written body (repeated keys cannot be built with a dict)."""
    return lambda channel: template.replace("CHAN", channel).replace(
        "RID", str(uuid.uuid4())).encode("utf-8")


CHANNEL = object()
_ENV = '"type":"broker_request","protocolVersion":1,"requestId":"RID","actionVersion":1'

#: (row name, body builder, the code the spec names). spec §Request, I1, I6, [C2].
MUTATIONS: list[tuple[str, Build, str]] = [
    # An unknown member anywhere (I1): top, args, args.target.
    ("unknown top member", lambda c: _post(c, requester=PK), "invalid_request"),
    ("unknown top member 'owner'", lambda c: _post(c, owner=PK), "invalid_request"),
    ("unknown member in args", _args("message.post", {"channelId": CHANNEL, "content": "x",
                                                      "pubkey": PK}), "invalid_request"),
    ("unknown member in args.target",
     _args("agents.delete", {"target": {"pubkey": PK, "owner": PK}}), "invalid_request"),
    ("unknown member in read args",
     _args("channel.read", {"channelId": CHANNEL, "since": 1}), "invalid_request"),
    ("unknown member in profile args",
     _args("profile.set", {"displayName": "x", "nip05": "a@b.test"}), "invalid_request"),
    # null anywhere (I6).
    ("null type", lambda c: _post(c, type=None), "invalid_request"),
    ("null actionVersion", lambda c: _post(c, actionVersion=None), "invalid_request"),
    ("null args", lambda c: _post(c, args=None), "invalid_request"),
    ("null optional arg", _args("message.post", {"channelId": CHANNEL, "content": "x",
                                                 "mentions": None}), "invalid_request"),
    ("null inside array", _args("message.post", {"channelId": CHANNEL, "content": "x",
                                                 "mentions": [None]}), "invalid_request"),
    ("null in target", _args("agents.delete", {"target": {"pubkey": PK, "name": None}}),
     "invalid_request"),
    ("null cursor", _args("channel.read", {"channelId": CHANNEL, "cursor": None}),
     "invalid_request"),
    # [] for an optional array (I6).
    ("empty mentions", _args("message.post", {"channelId": CHANNEL, "content": "x",
                                              "mentions": []}), "invalid_request"),
    # A repeated key, even with the same value.
    ("repeated top key", _raw('{' + _ENV + ',"action":"message.post","action":"message.post",'
                              '"args":{"channelId":"CHAN","content":"x"}}'), "invalid_request"),
    ("repeated args key", _raw('{' + _ENV + ',"action":"message.post","args":{"channelId":"CHAN",'
                               '"channelId":"CHAN","content":"x"}}'), "invalid_request"),
    ("repeated target key", _raw('{' + _ENV + ',"action":"agents.delete","args":{"target":'
                                 '{"pubkey":"' + PK + '","pubkey":"' + PK + '"}}}'),
     "invalid_request"),
    # Envelope shape (§Request).
    ("type not broker_request", lambda c: _post(c, type="broker_result"), "invalid_request"),
    ("type missing", lambda c: _post(c, type=DROP), "invalid_request"),
    ("args missing", lambda c: _post(c, args=DROP), "invalid_request"),
    ("action missing", lambda c: _post(c, action=DROP), "invalid_request"),
    ("actionVersion missing", lambda c: _post(c, actionVersion=DROP), "invalid_request"),
    ("args not an object", lambda c: _post(c, args=[c]), "invalid_request"),
    ("protocolVersion a string", lambda c: _post(c, protocolVersion="1"), "invalid_request"),
    # Versions.
    ("protocolVersion 2", lambda c: _post(c, protocolVersion=2), "unsupported_protocol_version"),
    ("protocolVersion 0", lambda c: _post(c, protocolVersion=0), "unsupported_protocol_version"),
    # NIP-BA: versions are u16, so -1 is malformed, not an unsupported version.
    ("protocolVersion -1", lambda c: _post(c, protocolVersion=-1), "invalid_request"),
    ("actionVersion 2", lambda c: _post(c, actionVersion=2), "unsupported_action_version"),
    ("actionVersion 0", lambda c: _post(c, actionVersion=0), "unsupported_action_version"),
    # Unknown, reserved and deferred action names.
    *[(f"action {name!r}", (lambda n: lambda c: _post(c, action=n))(name), "unknown_action")
      for name in _spec.NEVER_RESOLVE],
    # Argument validation (§Operations).
    ("limit 0", _args("channel.read", {"channelId": CHANNEL, "limit": 0}), "invalid_request"),
    ("limit 501", _args("channel.read", {"channelId": CHANNEL, "limit": 501}), "invalid_request"),
    ("empty cursor", _args("channel.read", {"channelId": CHANNEL, "cursor": ""}), "invalid_request"),
    ("cursor with a space", _args("channel.read", {"channelId": CHANNEL, "cursor": "a b"}),
     "invalid_request"),
    ("profile with no member", _args("profile.set", {}), "invalid_request"),
    ("update with target only", _args("agents.update", {"target": {"pubkey": PK}}),
     "invalid_request"),
    ("target with both selectors", _args("agents.delete", {"target": {"pubkey": PK, "name": "a"}}),
     "invalid_request"),
    ("respondTo allow-list", _args("agents.create", {"channelId": CHANNEL, "displayName": "a",
                                                     "systemPrompt": "p",
                                                     "respondTo": "allow-list"}),
     "invalid_request"),
    ("content too long", _args("message.post", {"channelId": CHANNEL,
                                                "content": "x" * (_spec.MAX_CONTENT_BYTES + 1)}),
     "invalid_request"),
    ("51 mentions", _args("message.post", {"channelId": CHANNEL, "content": "x",
                                           "mentions": [PK] * 51}), "invalid_request"),
    ("displayName 121 characters", _args("profile.set", {"displayName": "é" * 121}),
     "invalid_request"),
    ("reaction 67 characters", _args("reaction.add", {"channelId": CHANNEL, "targetEventId": EV,
                                                      "reaction": "x" * 67}), "invalid_request"),
    ("slug outside the grammar", _args("storage.address", {"slug": "mem/Upper"}),
     "invalid_request"),
    ("channel spelling braces and urn", lambda c: envelope_body("message.post", {
        "channelId": f"urn:uuid:{{{c}}}", "content": "x"}), "invalid_request"),
    ("channel hyphens misplaced", lambda c: envelope_body("message.post", {
        "channelId": c.replace("-", "")[:10] + "-" + c.replace("-", "")[10:], "content": "x"}),
     "invalid_request"),
]


@pytest.mark.parametrize("name,build,code", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_mutation_table_is_transcribed(name: str, build: Build, code: str) -> None:
    # Each row's body is valid JSON apart from the one mutation it names: a sanity check of
    # the table itself, so a typo cannot turn a row into a syntax error the host refuses
    # for another reason (which would answer HTTP 400 and no envelope).
    body = build(str(uuid.uuid4()))
    top = json.loads(body)
    assert isinstance(top, dict) and isinstance(top["requestId"], str)
    assert code in _spec.PAIRING and "failed" in _spec.PAIRING[code]


async def test_c2_every_mutation_fails_with_its_code_and_replays(broker: BrokerHarness) -> None:
    channel = str(uuid.uuid4())
    who = await known_agent(broker, "c2", [channel])
    wire = Wire(broker)
    wire.bind(who.credential, who.pubkey)
    wrong: list[tuple[str, str, str]] = []
    for name, build, code in MUTATIONS:
        body = build(channel)
        env = await wire.send(body, who.credential)
        got = (env["status"], env.get("error", {}).get("code", ""))
        if got != ("failed", code):
            wrong.append((name, code, f"{got}"))
            continue
        # I3: the identical bytes replay the recorded verdict, marked, otherwise identical.
        again = await wire.send(body, who.credential)
        assert again == {**env, "replayed": True}, (name, again)
    assert not wrong, wrong
    # None of them had a side effect on the relay.
    assert await fetch(broker, {"#h": [channel]}) == []


async def test_uncorrelatable_requests_get_no_envelope(broker: BrokerHarness) -> None:
    """§Request: a missing, null, repeated or malformed requestId cannot be answered with a
    verdict; whatever comes back must not pass for one."""
    channel = str(uuid.uuid4())
    who = await known_agent(broker, "rid", [channel])
    wire = Wire(broker)
    post = {"channelId": channel, "content": "x"}
    bodies = [
        envelope_body("message.post", post, requestId=DROP),
        envelope_body("message.post", post, requestId=None),
        envelope_body("message.post", post, request_id="has space"),
        envelope_body("message.post", post, request_id="x" * 129),
        envelope_body("message.post", post, request_id="é"),
        envelope_body("message.post", post, requestId=7),
        b'{"requestId":"a","requestId":"a","type":"broker_request"}',
        b"not json",
        b"[]",
    ]
    for body in bodies:
        reply = await wire.send_uncorrelated(body, who.credential)
        assert reply.status != 200 and reply.body == b"", (body, reply)
    assert await fetch(broker, {"#h": [channel]}) == []


def _read_outcome(envelope: dict[str, Any]) -> object:
    """A read's outcome as a re-executed read must repeat it: a `nextCursor` carries the
    second it was issued (daemon/relay/cursor.py), so a retry a second later is issued
    another; only whether there is one must match."""
    outcome = envelope.get("outcome")
    if isinstance(outcome, dict) and "nextCursor" in outcome:
        return {**outcome, "nextCursor": outcome["nextCursor"] is not None}
    return outcome


@pytest.mark.broker_config(policy={"models": ["m"]})  # the model it names, declared
async def test_valid_requests_and_replays_over_every_action(broker: BrokerHarness) -> None:
    """replayed:true only on a replay, omitted otherwise; a conflict never replays; a rejected
    credential is failed + unauthenticated whatever the body says (§Conformance)."""
    channel = str(uuid.uuid4())
    who = await known_agent(broker, "replays", [channel])
    wire = Wire(broker)
    wire.bind(who.credential, who.pubkey)
    post = await wire.ok(who, "message.post", {"channelId": channel, "content": "p"})
    calls: list[tuple[str, dict[str, Any]]] = [
        ("message.post", {"channelId": channel, "content": "again"}),
        ("message.reply", {"channelId": channel, "replyToEventId": post["eventId"], "content": "r"}),
        ("reaction.add", {"channelId": channel, "targetEventId": post["eventId"], "reaction": "+"}),
        ("profile.set", {"about": "a"}),
        ("storage.address", {"slug": "core"}),
        ("channel.read", {"channelId": channel, "limit": 2}),
        ("agents.create", {"channelId": channel, "displayName": "Kid", "systemPrompt": "p"}),
        ("agents.update", {"target": {"name": "Kid"}, "model": "m"}),
        ("agents.delete", {"target": {"name": "Kid"}}),
        ("message.post", {"channelId": str(uuid.uuid4()), "content": "not my channel"}),
    ]
    for action, args in calls:
        body = envelope_body(action, args)
        first = await wire.send(body, who.credential)
        assert "replayed" not in first
        second = await wire.send(body, who.credential)
        changed = body.replace(b'"actionVersion":1', b'"actionVersion": 1')
        conflict = await wire.send(changed, who.credential)
        if action in READS:
            # A read that ran leaves no record here (docs/protocol.md, "Where this host
            # and NIP-BA still differ"): its retry, and another body under its requestId,
            # are executed again, never replayed.
            for again in (second, conflict):
                assert "replayed" not in again, (action, again)
                assert (again["status"], _read_outcome(again)) == (
                    first["status"], _read_outcome(first)), (action, first, again)
            continue
        assert second == {**first, "replayed": True}, (action, first, second)
        assert (conflict["status"], conflict["error"]["code"]) == ("failed", "request_id_conflict")
        assert "replayed" not in conflict
    # A rejected credential: failed + unauthenticated, for a valid body and a broken one.
    for body in (envelope_body("message.post", {"channelId": channel, "content": "x"}),
                 envelope_body("message.post", {"channelId": channel}, protocolVersion=9),
                 envelope_body("nope", {"x": None})):
        for credential in (None, "not-a-credential", who.credential + "x"):
            env = await wire.send(body, credential)
            assert (env["status"], env["error"]["code"]) == ("failed", "unauthenticated")


async def test_http_binding(broker: BrokerHarness) -> None:
    """Only POST /v1/action; other routes and methods are transport answers without an
    envelope; every verdict (a refusal included) is HTTP 200 application/json."""
    channel = str(uuid.uuid4())
    who = await known_agent(broker, "http", [channel])
    body = envelope_body("message.post", {"channelId": channel, "content": "x"})
    auth = [("Authorization", f"Bearer {who.credential}"), ("Content-Type", "application/json")]
    for method, target, status in (("GET", "/v1/action", 405), ("PUT", "/v1/action", 405),
                                   ("DELETE", "/v1/action", 405), ("POST", "/v1/actions", 404),
                                   ("POST", "/", 404), ("POST", "/v2/action", 404),
                                   ("GET", "/v1", 404)):
        payload = body if method in ("POST", "PUT") else b""
        reply = await exchange(broker.socket, method, target, payload, auth)
        assert (reply.status, reply.body) == (status, b""), (method, target, reply)
        if status == 405:
            assert reply.headers.get("allow") == "POST"
    assert await fetch(broker, {"#h": [channel]}) == []
    wire = Wire(broker)
    env = await wire.send(body, who.credential)  # the recorder asserts 200 + JSON
    assert env["status"] == "succeeded"


async def test_largest_valid_content_gets_a_verdict(broker: BrokerHarness) -> None:
    channel = str(uuid.uuid4())
    who = await known_agent(broker, "big", [channel])
    content = "\x1b" * _spec.MAX_CONTENT_BYTES  # 64 KiB exactly, not whitespace: valid
    body = envelope_body("message.post", {"channelId": channel, "content": content})
    reply = await Wire(broker).send_uncorrelated(body, who.credential)
    assert reply.status == 200, reply.status
    env = json.loads(reply.body)
    # Validation passed; the development relay may still refuse a 64 KiB+ event by size
    # (a domain failure), which is a verdict all the same.
    assert env["status"] == "succeeded" or env["error"]["code"] == "action_failed", env
