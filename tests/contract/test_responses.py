"""Member tables, the status/code pairing table, response envelopes and events
(spec §Results, I1, I4, I6). Asserts codes, pointers and members, never message text."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from buzzwire.contract import (
    ACTIONS, MESSAGES, PAIRING, AgentsCreateOutcome, ContractError, ErrorCode, Event,
    Response, Rule, Status, StorageAddressOutcome, StorageGetOutcome, Verdict,
    encode_response, mark_replayed, parse_response,
)
from buzzwire.contract._shapes import SHAPES
from tests.contract.vectors import CHANNEL, EVENT, PK2, REQUEST_ID, VALID_OUTCOMES, Pairs, body

# The eighteen member sets, transcribed from spec §Operations and wire-schema.md by hand
# (tests/contract/test_wire_schema.py checks this transcription against wire-schema.md): (args required,
# args optional, outcome required, outcome optional). Changing a shape means changing this.
SPEC_MEMBERS: dict[str, tuple[set[str], set[str], set[str], set[str]]] = {
    "channel.read": ({"channelId"}, {"rootEventId", "mentionsOnly", "cursor", "limit"},
                     {"messages"}, {"nextCursor"}),
    "message.post": ({"channelId", "content"}, {"mentions"}, {"eventId", "kind", "createdAt"}, set()),
    "message.reply": ({"channelId", "replyToEventId", "content"}, {"mentions"},
                      {"eventId", "kind", "createdAt"}, set()),
    "reaction.add": ({"channelId", "targetEventId", "reaction"}, set(), {"eventId", "kind", "createdAt"}, set()),
    "profile.set": (set(), {"displayName", "about", "picture"}, {"eventId", "kind", "createdAt"}, set()),
    "storage.address": ({"slug"}, set(), {"authorPubkey", "kind", "dTag"}, set()),
    "storage.get": ({"slug"}, set(), set(), {"value"}),
    "storage.put": ({"slug", "value"}, set(), {"eventId", "kind", "createdAt"}, set()),
    "agents.create": ({"channelId", "displayName", "systemPrompt"},
                      {"runtime", "provider", "model", "respondTo"},
                      {"agentPubkey", "displayName", "channelId"}, set()),
    "agents.update": ({"target"}, {"displayName", "systemPrompt", "runtime", "provider", "model", "respondTo"},
                      {"agentPubkey", "displayName", "updatedFields"}, set()),
    "agents.delete": ({"target"}, set(), {"agentPubkey", "displayName"}, set()),
    # NIP-BA "Actions": the live signals answer Published.
    "presence.set": ({"status"}, set(), {"eventId", "kind", "createdAt"}, set()),
    "typing.set": ({"channelId"}, set(), {"eventId", "kind", "createdAt"}, set()),
    # NIP-BA "Actions": observer.emit and liveness.ping
    "observer.emit": ({"frames"}, set(), {"accepted"}, set()),
    "liveness.ping": ({"channelId", "turnId"}, set(), {"eventId", "kind", "createdAt"}, set()),
}

# spec §Results, the complete table: code -> (with failed, with indeterminate)
SPEC_PAIRING = {
    "invalid_request": (True, False), "unsupported_protocol_version": (True, False),
    "unknown_action": (True, False), "unsupported_action_version": (True, False),
    "unsupported": (True, False), "unauthenticated": (True, False), "unauthorized": (True, False),
    "request_id_conflict": (True, False), "action_failed": (True, False),
    "outcome_unknown": (False, True), "internal": (True, True),
}


def test_the_eighteen_member_sets() -> None:
    assert set(ACTIONS) == set(SPEC_MEMBERS)
    for name, (a_req, a_opt, o_req, o_opt) in SPEC_MEMBERS.items():
        spec = ACTIONS[name]
        assert spec.name == name
        assert (spec.arg_members.required, spec.arg_members.optional) == (a_req, a_opt), name
        assert (spec.outcome_members.required, spec.outcome_members.optional) == (o_req, o_opt), name
    # NIP-BA "Live signals": reaction and the live actions are best effort.
    assert {n for n, s in ACTIONS.items() if s.best_effort} == {
        "reaction.add", "presence.set", "typing.set", "observer.emit", "liveness.ping"}
    assert {n for n, s in ACTIONS.items() if not s.publishing} == {
        "channel.read", "storage.address", "storage.get"}


def test_event_has_exactly_seven_members() -> None:
    assert {f.wire for f in SHAPES[Event].fields} == {
        "id", "pubkey", "created_at", "kind", "tags", "content", "sig"}


def test_defaults_equal_absent_values_and_classes_are_frozen_slotted_kw_only() -> None:
    # The reader builds instances without __init__ (see _shapes); this keeps that honest.
    for cls, shape in SHAPES.items():
        params = dataclasses.fields(cls)
        assert cls.__dataclass_params__.frozen and hasattr(cls, "__slots__")  # type: ignore[attr-defined]
        assert all(p.kw_only for p in params)
        by_attr = {p.name: p for p in params}
        assert set(by_attr) == {f.attr for f in shape.fields}
        for f in shape.fields:
            if not f.required:
                assert by_attr[f.attr].default == f.absent, (cls, f.attr)


def test_codes_and_messages_transcribe_the_table() -> None:
    assert {c.value for c in ErrorCode} == set(SPEC_PAIRING)
    assert set(MESSAGES) == set(ErrorCode) == set(PAIRING)
    assert {s.value for s in Status} == {"succeeded", "failed", "indeterminate"}


@pytest.mark.parametrize("code", list(ErrorCode))
@pytest.mark.parametrize("status", [Status.FAILED, Status.INDETERMINATE])
def test_each_code_with_each_status(code: ErrorCode, status: Status) -> None:
    allowed = SPEC_PAIRING[code.value][0 if status is Status.FAILED else 1]
    assert (status in PAIRING[code]) is allowed
    make = Verdict.failed if status is Status.FAILED else Verdict.indeterminate
    wire = {"type": "broker_result", "protocolVersion": 1, "requestId": REQUEST_ID,
            "status": status.value, "error": {"code": code.value, "message": "m"}}
    if allowed:
        verdict = make(code)
        assert verdict.message == MESSAGES[code]
        response = parse_response(encode_response(REQUEST_ID, verdict))
        assert (response.status, response.code, response.message) == (status, code, MESSAGES[code])
        assert parse_response(body(wire)).code is code
    else:
        with pytest.raises(AssertionError):
            make(code, "m")
        with pytest.raises(ContractError) as err:
            parse_response(body(wire))
        assert err.value.pointer == "/error/code"
    with pytest.raises(ContractError):  # succeeded never carries an error
        parse_response(body({**wire, "status": "succeeded"}))


SPEC_EXAMPLES = [
    b'{ "type": "broker_result", "protocolVersion": 1, "requestId": "a9f3c2e1-0b5d-4e8a-9c71-3f2b6d8e4a10",'
    b'  "status": "succeeded", "action": "message.reply",'
    b'  "outcome": { "eventId": "5ff391bf2c6d4e8a9b7c1d3e5f7a9b1c3d5e7f9a1b3c5d7e9f1a3b5c7d9e1f3a",'
    b'               "kind": 9, "createdAt": 1787675471 } }',
    b'{ "type": "broker_result", "protocolVersion": 1, "requestId": "a9f3c2e1-0b5d-4e8a-9c71-3f2b6d8e4a10",'
    b'  "status": "failed",'
    b'  "error": { "code": "unauthorized", "message": "agents.create is not permitted for this session" } }',
    b'{ "type": "broker_result", "protocolVersion": 1, "requestId": "a9f3c2e1-0b5d-4e8a-9c71-3f2b6d8e4a10",'
    b'  "status": "indeterminate",'
    b'  "error": { "code": "outcome_unknown", "message": "relay connection dropped after publish was attempted" } }',
]


def _verdict_of(response: Response) -> Verdict:
    return Verdict(status=response.status, action=response.action, outcome=response.outcome,
                   code=response.code, message=response.message)


@pytest.mark.parametrize("example", SPEC_EXAMPLES)
def test_spec_examples_parse_and_reserialize_to_the_same_members(example: bytes) -> None:
    response = parse_response(example)
    again = encode_response(response.request_id, _verdict_of(response))
    assert json.loads(again) == json.loads(example)
    assert parse_response(again) == response
    with pytest.raises(ContractError):
        parse_response(example + b"x")  # trailing junk


@pytest.mark.parametrize("action", sorted(ACTIONS))
def test_every_outcome_round_trips(action: str) -> None:
    wire = {"type": "broker_result", "protocolVersion": 1, "requestId": REQUEST_ID,
            "status": "succeeded", "action": action, "outcome": VALID_OUTCOMES[action]}
    response = parse_response(body(wire))
    assert type(response.outcome) is ACTIONS[action].outcome_type
    encoded = encode_response(REQUEST_ID, Verdict.succeeded(action, response.outcome))  # type: ignore[arg-type]
    assert json.loads(encoded) == wire
    assert b" " not in encoded.replace(b"Scout 2", b"").replace(b"hi @scout", b"")  # compact
    # strict members inside the outcome: extra, null, repeated, missing
    outcome = VALID_OUTCOMES[action]
    for bad, pointer in [({**outcome, "secretKey": "x"}, "/outcome/secretKey")] + [
        ({**outcome, m: None}, f"/outcome/{m}") for m in outcome
    ] + [(Pairs([*outcome.items(), (m, outcome[m])]), f"/outcome/{m}") for m in outcome] + [
        ({k: v for k, v in outcome.items() if k != m}, f"/outcome/{m}")
        for m in ACTIONS[action].outcome_members.required
    ]:
        with pytest.raises(ContractError) as err:
            parse_response(body({**wire, "outcome": bad}))
        assert err.value.pointer == pointer, (action, pointer)
    with pytest.raises(AssertionError):  # an outcome of the wrong type for the action
        Verdict.succeeded("storage.address" if action != "storage.address" else "channel.read",
                          response.outcome)  # type: ignore[arg-type]


def test_optional_members_are_omitted_never_null() -> None:
    outcome = parse_response(body({"type": "broker_result", "protocolVersion": 1, "requestId": "r",
                                   "status": "succeeded", "action": "channel.read",
                                   "outcome": {"messages": []}})).outcome
    encoded = encode_response("r", Verdict.succeeded("channel.read", outcome))  # type: ignore[arg-type]
    assert json.loads(encoded)["outcome"] == {"messages": []}
    assert b"null" not in encoded and b"replayed" not in encoded


@pytest.mark.parametrize(("wire_over", "pointer"), [
    ({"outcome": {"eventId": "ab" * 32, "kind": 9, "createdAt": 1}}, "/outcome"),  # failed + outcome
    ({"action": "message.post"}, "/action"),
    ({"extra": 1}, "/extra"),
    ({"type": "broker_request"}, "/type"),
    ({"protocolVersion": 2}, "/protocolVersion"),
    ({"status": "ok"}, "/status"),
    ({"requestId": "a b"}, "/requestId"),
    ({"replayed": False}, "/replayed"),
    ({"error": {"code": "unauthorized", "message": "m", "detail": "x"}}, "/error/detail"),
    ({"error": {"code": "nope", "message": "m"}}, "/error/code"),
    ({"error": {"code": "unauthorized"}}, "/error/message"),
    ({"error": {"code": "unauthorized", "message": None}}, "/error/message"),
    ({"outcome": None}, "/outcome"),
])
def test_failed_response_faults(wire_over: dict[str, Any], pointer: str) -> None:
    wire = {"type": "broker_result", "protocolVersion": 1, "requestId": REQUEST_ID,
            "status": "failed", "error": {"code": "unauthorized", "message": "m"}, **wire_over}
    with pytest.raises(ContractError) as err:
        parse_response(body(wire))
    assert (err.value.code, err.value.pointer) == (ErrorCode.INVALID_REQUEST, pointer)


def test_replayed_only_when_true() -> None:
    original = encode_response(REQUEST_ID, Verdict.failed(ErrorCode.UNAUTHENTICATED))
    replayed = mark_replayed(original)
    assert replayed == original[:-1] + b',"replayed":true}'
    assert parse_response(replayed).replayed is True
    assert parse_response(original).replayed is False
    with pytest.raises(ValueError):
        mark_replayed(replayed)
    with pytest.raises(ContractError):
        parse_response(replayed[:-1] + b',"replayed":true}')  # repeated key


def test_events_are_held_to_seven_members() -> None:
    assert Event.from_json_obj(EVENT).to_json_obj() == EVENT
    wire = {"type": "broker_result", "protocolVersion": 1, "requestId": REQUEST_ID,
            "status": "succeeded", "action": "channel.read", "outcome": {"messages": [EVENT, EVENT]}}
    assert len(parse_response(body(wire)).outcome.messages) == 2  # type: ignore[union-attr]
    for bad, pointer in [
        ({**EVENT, "relay": "x"}, "/outcome/messages/1/relay"),
        ({k: v for k, v in EVENT.items() if k != "sig"}, "/outcome/messages/1/sig"),
        ({**EVENT, "id": EVENT["id"].upper()}, "/outcome/messages/1/id"),  # verbatim, not rewritten
        ({**EVENT, "tags": [["h", None]]}, "/outcome/messages/1/tags/0/1"),
        ({**EVENT, "tags": [["h", 1]]}, "/outcome/messages/1/tags/0/1"),
        ({**EVENT, "kind": 70000}, "/outcome/messages/1/kind"),
        ({**EVENT, "created_at": 1.5}, "/outcome/messages/1/created_at"),
        ({**EVENT, "sig": "ab" * 32}, "/outcome/messages/1/sig"),
        # a Schnorr signature is exactly 128 hex digits: one short or one over is no event
        ({**EVENT, "sig": "ab" * 63 + "a"}, "/outcome/messages/1/sig"),
        ({**EVENT, "sig": "ab" * 64 + "a"}, "/outcome/messages/1/sig"),
    ]:
        with pytest.raises(ContractError) as err:
            parse_response(body({**wire, "outcome": {"messages": [EVENT, bad]}}))
        assert err.value.pointer == pointer
    with pytest.raises(ContractError) as err:
        Event.from_json_obj({**EVENT, "extra": 1})
    assert err.value.pointer == "/extra"


def test_a_page_of_built_events_is_checked_as_a_page_of_wire_events() -> None:
    """ReadOutcome passes a tuple of built Events at once (the read path builds one per
    answer); anything else in the tuple is still refused, and the limit still holds."""
    from buzzwire.contract import ReadOutcome

    event = Event.from_json_obj(EVENT)
    page = (event, event)
    assert ReadOutcome(messages=page).messages is page
    for bad in (EVENT, None, "x", ((event,),)):
        with pytest.raises(ValueError):
            ReadOutcome(messages=(event, bad))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ReadOutcome(messages=(event,) * 501)


def test_a_page_never_exceeds_the_largest_limit() -> None:
    wire = {"type": "broker_result", "protocolVersion": 1, "requestId": REQUEST_ID,
            "status": "succeeded", "action": "channel.read", "outcome": {"messages": [EVENT] * 501}}
    with pytest.raises(ContractError) as err:
        parse_response(body(wire))
    assert err.value.pointer == "/outcome/messages"


def test_outcome_identities_are_canonical() -> None:
    outcome = {**VALID_OUTCOMES["agents.create"], "channelId": VALID_OUTCOMES["agents.create"]["channelId"].upper()}
    wire = {"type": "broker_result", "protocolVersion": 1, "requestId": REQUEST_ID,
            "status": "succeeded", "action": "agents.create", "outcome": outcome}
    assert parse_response(body(wire)).outcome == parse_response(
        body({**wire, "outcome": VALID_OUTCOMES["agents.create"]})).outcome


#: 64 hex digits that are no x-only point: x >= the field prime, and x = 5 (5**3 + 7 is no
#: square mod p).
NOT_POINTS = ["f" * 64, "00" * 31 + "05"]


@pytest.mark.parametrize("not_a_point", NOT_POINTS, ids=["past-p", "no-y"])
def test_storage_address_author_must_be_a_point(not_a_point: str) -> None:
    # Like every outcome pubkey, authorPubkey is a secp256k1 point: 64 hex digits alone
    # would let a host name an author no key can sign as.
    wire = {"type": "broker_result", "protocolVersion": 1, "requestId": REQUEST_ID,
            "status": "succeeded", "action": "storage.address",
            "outcome": VALID_OUTCOMES["storage.address"]}
    assert parse_response(body(wire)).outcome is not None
    with pytest.raises(ContractError) as err:
        parse_response(body({**wire, "outcome": {**VALID_OUTCOMES["storage.address"],
                                                  "authorPubkey": not_a_point}}))
    assert (err.value.pointer, err.value.rule) == ("/outcome/authorPubkey", Rule.PUBKEY)
    with pytest.raises(ValueError):
        StorageAddressOutcome(author_pubkey=not_a_point, kind=30174, d_tag="ab" * 32)


@pytest.mark.parametrize("build", [
    pytest.param(lambda s: AgentsCreateOutcome(agent_pubkey=PK2, display_name=s,
                                               channel_id=CHANNEL), id="agents.create"),
    pytest.param(lambda s: StorageGetOutcome(value=s), id="storage.get"),
    pytest.param(lambda s: Event(id=EVENT["id"], pubkey=EVENT["pubkey"],
                                 created_at=EVENT["created_at"], kind=EVENT["kind"], tags=(),
                                 content=s, sig=EVENT["sig"]), id="event"),
])
@pytest.mark.parametrize("lone", ["\ud800", "\udfff"])
def test_an_outcome_holding_a_lone_surrogate_cannot_be_built(build: Any, lone: str) -> None:
    # The reader refuses it on the wire before any checker runs; built directly (a host's
    # verdict, a test double), only the checkers keep out text no UTF-8 response can carry.
    build("Ada")
    with pytest.raises(ValueError):
        build(f"Ada{lone}")


def test_encode_response_refuses_an_uncorrelated_id() -> None:
    with pytest.raises(ValueError):
        encode_response("has space", Verdict.failed(ErrorCode.INTERNAL))
