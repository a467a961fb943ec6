"""The message an agent is told for each rule it breaks (issue 25 item 3), from `Rule`.

Rules:
- `CASES` holds one provoking input per member of `buzzwire.contract.Rule`, the table of
  invalid_request reasons; a member without a case fails `test_every_rule_has_a_case`, so
  the table cannot grow a rule nobody has seen produced.
- Each case names the pointer the agent must be shown and a marker: the offending value
  (or the client-chosen member name) written into the input. The message must be exactly
  `<shown pointer>: <the rule's reason>`, the reason must be the rule's template filled with
  host numbers and words only, and the marker must appear nowhere in the message.
- A client-chosen member name is never in the message: it is given by position,
  `<member N>`, however it is spelled and however deep.
"""

from __future__ import annotations

import json
from pathlib import Path
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from buzzwire.contract import (
    MAX_SHOWN_POINTER_CHARS, MESSAGES, ContractError, ErrorCode, Event, Rule, build_request,
    parse_response, printable, read_request, refusal_message,
)
from tests.contract.vectors import (
    CHANNEL, EVENT, PK1, REQUEST_ID, VALID_ARGS, VALID_OUTCOMES, Pairs, body, envelope,
    reason_pattern,
)

#: Written into every offending value or chosen member name: the message must not hold it.
SECRET = "bzb_SECRETSECRETSECRET"


def _request(raw: bytes) -> ContractError:
    reading = read_request(raw)
    assert reading.error is not None, "the case must be refused"
    return reading.error


def _args(action: str, **members: Any) -> Callable[[], ContractError]:
    return lambda: _request(body(envelope(action, {**VALID_ARGS[action], **members})))


def _raw(args_text: str, action: str = "channel.read") -> Callable[[], ContractError]:
    """A request whose `args` is written verbatim (repeated keys, surrogate escapes)."""
    env = json.dumps(envelope(action, {}), separators=(",", ":"))
    return lambda: _request(env.replace('"args":{}', f'"args":{args_text}').encode())


def _response(**over: Any) -> Callable[[], ContractError]:
    base: dict[str, Any] = {"type": "broker_result", "protocolVersion": 1,
                            "requestId": REQUEST_ID, "status": "succeeded",
                            "action": "channel.read", "outcome": VALID_OUTCOMES["channel.read"]}
    base.update(over)

    def read() -> ContractError:
        with pytest.raises(ContractError) as info:
            parse_response(body({k: v for k, v in base.items() if v is not _DROP}))
        return info.value

    return read


def _failed(**error: Any) -> Callable[[], ContractError]:
    return _response(status="failed", action=_DROP, outcome=_DROP, error=error)


def _event(**over: Any) -> Callable[[], ContractError]:
    return _response(outcome={"messages": [{**EVENT, **over}]})


def _built(args: dict[str, Any]) -> Callable[[], ContractError]:
    def build() -> ContractError:
        with pytest.raises(ContractError) as info:
            build_request("message.post", args, request_id=REQUEST_ID)
        return info.value

    return build


_DROP = object()
_OFF_CURVE = "f" * 64  # >= the field prime: no point has it as x
_CHAN = {"channelId": CHANNEL}


@dataclass(frozen=True)
class Case:
    produce: Callable[[], ContractError]
    #: the pointer the agent must be shown
    shown: str
    #: text of the offending input that must not be in the message (None: nothing to hide)
    marker: str | None = SECRET


CASES: dict[Rule, Case] = {
    Rule.SYNTAX: Case(lambda: _request(b'{"requestId":"r1",' + SECRET.encode()), ""),
    Rule.TOP_NOT_OBJECT: Case(lambda: _request(body([SECRET])), ""),
    Rule.REQUEST_ID: Case(lambda: _request(body(envelope(requestId=f"a {SECRET}"))), "/requestId"),
    Rule.NULL: Case(_raw(f'{{"{SECRET}":{{"x":null}}}}'), "/args/<member 1>/<member 1>"),
    Rule.REPEATED_MEMBER: Case(_raw(f'{{"channelId":"{CHANNEL}","{SECRET}":1,"{SECRET}":2}}'),
                               "/args/<member 2>"),
    Rule.MEMBER_NAME_SURROGATE: Case(_raw(f'{{"\\ud800{SECRET}":1}}'), "/args"),
    Rule.LONE_SURROGATE: Case(_raw(f'{{"channelId":"{CHANNEL}","content":"\\ud800{SECRET}"}}',
                                   "message.post"), "/args/content"),
    Rule.NOT_INTEGER: Case(_raw(f'{{"channelId":"{CHANNEL}","limit":98765.5}}'), "/args/limit",
                           "98765"),
    Rule.INTEGER_PAST_64_BITS: Case(_raw(f'{{"channelId":"{CHANNEL}","limit":98765{"0" * 20}}}'),
                                    "/args/limit", "98765"),
    Rule.TYPE: Case(lambda: _request(body(envelope(type=SECRET))), "/type"),
    Rule.U16: Case(lambda: _request(body(envelope(actionVersion=987654))), "/actionVersion",
                   "987654"),
    Rule.EXPECTED_OBJECT: Case(lambda: _request(body(envelope(args=SECRET))), "/args"),
    Rule.UNKNOWN_MEMBER: Case(lambda: _request(body(envelope("channel.read", {
        "channelId": CHANNEL, SECRET: 1}))), "/args/<member 2>"),
    Rule.MISSING_MEMBER: Case(lambda: _request(body(envelope("message.post", _CHAN))),
                              "/args/content", None),
    Rule.EXPECTED_STRING: Case(_args("message.post", content=987654), "/args/content", "987654"),
    Rule.EXPECTED_BOOLEAN: Case(_args("channel.read", mentionsOnly=SECRET), "/args/mentionsOnly"),
    Rule.EXPECTED_INTEGER: Case(_args("channel.read", limit=SECRET), "/args/limit"),
    Rule.INTEGER_RANGE: Case(_args("channel.read", limit=987654), "/args/limit", "987654"),
    Rule.CHANNEL: Case(_args("typing.set", channelId=SECRET), "/args/channelId"),
    Rule.HEX64: Case(_args("channel.read", rootEventId=SECRET), "/args/rootEventId"),
    Rule.PUBKEY: Case(_args("message.post", mentions=[PK1, _OFF_CURVE]), "/args/mentions/1",
                      _OFF_CURVE),
    Rule.VISIBLE_ASCII: Case(_args("channel.read", cursor=f"a {SECRET}"), "/args/cursor"),
    Rule.SLUG: Case(_args("storage.get", slug=SECRET), "/args/slug"),
    Rule.SLUG_CHARACTER: Case(_args("storage.get", slug=f"mem/{SECRET}"), "/args/slug"),
    Rule.SLUG_SEGMENT_START: Case(_args("storage.get", slug="mem/_secretsecret"), "/args/slug",
                                  "secretsecret"),
    Rule.SLUG_SEGMENT_LONG: Case(_args("storage.get", slug="mem/" + "secret" * 11),
                                 "/args/slug", "secret"),
    Rule.BLANK: Case(_args("message.post", content=" \u3000 "), "/args/content", None),
    Rule.CHARS: Case(_args("profile.set", displayName=SECRET * 6), "/args/displayName"),
    Rule.BYTES: Case(_args("message.post", content=SECRET * 3000), "/args/content"),
    Rule.LINE_CHARACTER: Case(_args("profile.set", displayName=f"{SECRET}\x07"),
                              "/args/displayName"),
    Rule.PROSE_CHARACTER: Case(_args("profile.set", about=f"{SECRET}\x1b[2J"), "/args/about"),
    Rule.ONE_OF: Case(_args("presence.set", status=SECRET), "/args/status"),
    Rule.EXPECTED_ARRAY: Case(_args("message.post", mentions=SECRET), "/args/mentions"),
    Rule.EMPTY_ARRAY: Case(_args("message.post", mentions=[]), "/args/mentions", None),
    Rule.ITEMS: Case(_args("message.post", mentions=[PK1] * 51), "/args/mentions", PK1),
    Rule.AT_LEAST_ONE: Case(lambda: _request(body(envelope("profile.set", {}))), "/args", None),
    Rule.AT_LEAST_ONE_BESIDES_TARGET: Case(
        lambda: _request(body(envelope("agents.update", {"target": {"name": SECRET}}))), "/args"),
    Rule.ONE_TARGET: Case(lambda: _request(body(envelope("agents.delete", {
        "target": {"pubkey": PK1, "name": SECRET}}))), "/args/target"),
    Rule.RECORD_BODY: Case(_args("storage.put", slug="core",
                                 value=SECRET + "x" * (65_535 - len(SECRET))), "/args"),
    Rule.FRAMES_BODY: Case(_args("observer.emit", frames=[
        {"kind": "acp_read", "payload": SECRET * 1500}] * 2), "/args"),
    Rule.NOT_JSON_VALUE: Case(_built({**_CHAN, "content": {1.5, 2.5}}), "/args", None),
    Rule.LOWER_HEX64: Case(_event(id=SECRET), "/outcome/messages/0/id"),
    Rule.LOWER_HEX128: Case(_event(sig=SECRET), "/outcome/messages/0/sig"),
    Rule.PROTOCOL_VERSION_ONE: Case(_response(protocolVersion=987654), "/protocolVersion",
                                    "987654"),
    Rule.STATUS: Case(_response(status=SECRET), "/status"),
    Rule.NOT_WITH_STATUS: Case(_response(**{SECRET: 1}), "/<member 7>"),
    Rule.REPLAYED: Case(_response(replayed=False), "/replayed", None),
    Rule.ACTION_NAME: Case(_response(action=SECRET), "/action"),
    Rule.ERROR_CODE: Case(_failed(code=SECRET, message="m"), "/error/code"),
    Rule.PAIRING: Case(_failed(code="outcome_unknown", message=SECRET), "/error/code"),
}


def test_every_rule_has_a_case() -> None:
    assert set(CASES) == set(Rule)


@pytest.mark.parametrize("rule", list(Rule), ids=lambda r: r.name)
def test_each_rule_produces_its_message(rule: Rule) -> None:
    case = CASES[rule]
    error = case.produce()
    assert (error.code, error.rule) == (ErrorCode.INVALID_REQUEST, rule)
    assert reason_pattern(rule).fullmatch(error.reason), (rule, error.reason)
    assert error.message == f"{case.shown or '(document)'}: {error.reason}"
    if case.marker is not None:
        assert case.marker not in error.message
    assert SECRET not in error.message
    assert printable(error.message) == error.message  # nothing a terminal acts on
    assert error.message != MESSAGES[ErrorCode.INVALID_REQUEST]


def test_a_template_is_filled_only_by_the_host() -> None:
    # A placeholder is a host limit or a host enum the checker passes in; a template with
    # none is its own reason, and one with a placeholder cannot be rendered without it.
    for rule in Rule:
        if "{" in rule.value:
            with pytest.raises(KeyError):
                rule.reason()
        else:
            assert rule.reason() == rule.value


@pytest.mark.parametrize("name", [SECRET, "", "a/b~c", "\u202e\x1b[2J", "0", "limit\n"],
                         ids=["token", "empty", "escapes", "controls", "digit", "newline"])
def test_a_chosen_member_name_is_given_by_position(name: str) -> None:
    # Known names (`limit`) and indices are the host's; any other name, even "0" or one a
    # known name with a newline, is the sender's and is shown by its position only.
    error = _request(body(envelope("channel.read", Pairs([*VALID_ARGS["channel.read"].items(),
                                                          (name, 1)]))))
    assert error.message == "/args/<member 6>: unknown member"
    nested = _request(body(envelope("channel.read", {"channelId": CHANNEL,
                                                     name: {"deeper": [None]}})))
    assert nested.message == "/args/<member 2>/<member 1>/0: null is never a legal value"


def test_the_shown_pointer_is_bounded_however_deep() -> None:
    deep: Any = None
    for index in range(14):
        deep = {f"{SECRET}{index}" * 50: deep}
    error = _request(body(envelope("channel.read", {"channelId": CHANNEL, "x": deep})))
    assert error.rule is Rule.NULL and SECRET not in error.message
    assert len(error.message) <= MAX_SHOWN_POINTER_CHARS + 2 + len(Rule.NULL.value)
    assert error.message.startswith("/args/<member 2>/<member 1>/<member 1>")


def test_a_pointer_is_cut_at_exactly_the_bound() -> None:
    # The documented bound, to the character: a pointer of MAX_SHOWN_POINTER_CHARS is shown
    # whole, and a longer one is cut to that many characters, its "…" included.
    at = "/" + "a" * (MAX_SHOWN_POINTER_CHARS - 1)
    assert refusal_message(at, "why") == f"{at}: why"
    over = at + "a"
    assert refusal_message(over, "why") == f"{over[:MAX_SHOWN_POINTER_CHARS - 1]}…: why"


def test_an_error_no_reader_has_shown_hides_every_segment() -> None:
    # Event.from_json_obj refuses before any reader could tell the host's names from the
    # sender's, so every segment is hidden: a chosen name (a pasted token) is never echoed.
    with pytest.raises(ContractError) as chosen:
        Event.from_json_obj({**EVENT, SECRET: 1})
    assert chosen.value.shown is None
    assert chosen.value.message == "/<member>: unknown member"
    with pytest.raises(ContractError) as deep:
        Event.from_json_obj({**EVENT, "tags": [["h", 7]]})
    assert deep.value.message == "/<member>/<member>/<member>: expected a string"


def test_the_other_codes_keep_their_fixed_message() -> None:
    for over, code in (({"protocolVersion": 2}, ErrorCode.UNSUPPORTED_PROTOCOL_VERSION),
                       ({"action": SECRET}, ErrorCode.UNKNOWN_ACTION),
                       ({"actionVersion": 2}, ErrorCode.UNSUPPORTED_ACTION_VERSION)):
        error = _request(body(envelope(**over)))
        assert (error.code, error.rule, error.message) == (code, None, MESSAGES[code])


def test_the_examples_in_the_protocol_doc_are_messages_the_rules_produce() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()
    section = text.split("### What an `invalid_request` message says", 1)[1]
    block = section.split("```text\n", 1)[1].split("```", 1)[0]
    produced = {case.produce().message for case in CASES.values()}
    examples = block.strip().splitlines()
    assert examples and set(examples) <= produced, set(examples) - produced
    assert f"longer than {MAX_SHOWN_POINTER_CHARS} characters is cut" in section
