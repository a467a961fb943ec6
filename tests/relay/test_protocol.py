"""daemon.relay.protocol: one table of frames drives the parser; refusals assert codes."""

from __future__ import annotations

import json
from typing import Any

import pytest

from buzzwire.nostr import SignedEvent

from daemon.relay.protocol import (
    MAX_REASON_CHARS,
    AuthChallenge,
    Closed,
    EndOfStoredEvents,
    EventMessage,
    Notice,
    Ok,
    Prefix,
    RelayProtocolError,
    check_relay_url,
    encode_auth,
    encode_close,
    encode_event,
    encode_req,
    machine_prefix,
    parse_relay_message,
    quote_reason,
    subscription_id,
)

ID = "ab" * 32
EV: dict[str, Any] = {
    "id": ID, "pubkey": "cd" * 32, "created_at": 1, "kind": 9,
    "tags": [["h", "x"]], "content": "héllo", "sig": "ef" * 64,
}

GOOD: list[tuple[str, object]] = [
    (json.dumps(["EVENT", "q0", EV], ensure_ascii=False), EventMessage(subscription_id="q0", event=EV)),
    (json.dumps(["OK", ID, True, ""]), Ok(event_id=ID, accepted=True, message="")),
    (json.dumps(["OK", ID, False, "blocked: no"]), Ok(event_id=ID, accepted=False, message="blocked: no")),
    (json.dumps(["EOSE", "q1"]), EndOfStoredEvents(subscription_id="q1")),
    (json.dumps(["CLOSED", "q1", "restricted: x"]), Closed(subscription_id="q1", message="restricted: x")),
    (json.dumps(["NOTICE", "hi"]), Notice(message="hi")),
    (json.dumps(["AUTH", "c0ffee"]), AuthChallenge(challenge="c0ffee")),
]

BAD: list[tuple[str | bytes, str]] = [
    ("", "not_json"),
    ("[", "not_json"),
    (b"\xff[]", "not_json"),
    ('["OK", "' + ID + '", true, ""] junk', "not_json"),
    ('["NOTICE", NaN]', "not_json"),
    ('["EVENT", "q", {"id": 1, "id": 2}]', "not_json"),
    ("{}", "not_array"),
    ("[]", "not_array"),
    ('["PING"]', "unknown_verb"),
    ("[1, 2]", "unknown_verb"),
    ('["EOSE"]', "bad_arity"),
    ('["OK", "' + ID + '", true]', "bad_arity"),
    ('["EVENT", "q", {}, {}]', "bad_arity"),
    ('["OK", "' + ID + '", 1, ""]', "bad_member"),
    ('["OK", "' + ID.upper() + '", true, ""]', "bad_member"),
    ('["OK", "' + ID + '", true, null]', "bad_member"),
    ('["EVENT", "q", []]', "bad_member"),
    ('["EVENT", "", {}]', "bad_member"),
    ('["EOSE", "' + "x" * 65 + '"]', "bad_member"),
    ('["AUTH", ""]', "bad_member"),
    ('["CLOSED", 3, "x"]', "bad_member"),
]


@pytest.mark.parametrize(("frame", "expected"), GOOD)
def test_parses(frame: str, expected: object) -> None:
    assert parse_relay_message(frame) == expected
    assert parse_relay_message(frame.encode("utf-8")) == expected


@pytest.mark.parametrize(("frame", "expected"), GOOD)
def test_every_truncation_and_trailing_junk_is_refused(frame: str, expected: object) -> None:
    for cut in range(len(frame)):
        with pytest.raises(RelayProtocolError):
            parse_relay_message(frame[:cut])
    with pytest.raises(RelayProtocolError):
        parse_relay_message(frame + ",")


@pytest.mark.parametrize(("frame", "code"), BAD)
def test_refuses_with_a_code(frame: str | bytes, code: str) -> None:
    with pytest.raises(RelayProtocolError) as info:
        parse_relay_message(frame)
    assert info.value.code == code


def test_prefixes() -> None:
    assert machine_prefix("duplicate: have it") is Prefix.DUPLICATE
    assert machine_prefix("auth-required: do it") is Prefix.AUTH_REQUIRED
    assert machine_prefix("restricted: no") is Prefix.RESTRICTED
    assert machine_prefix("rate-limited: slow") is Prefix.RATE_LIMITED
    assert machine_prefix("whatever: x") is None
    assert machine_prefix("no prefix") is None
    assert Ok(event_id=ID, accepted=True, message="duplicate: x").prefix is Prefix.DUPLICATE


def test_encoders_round_trip_and_keep_utf8() -> None:
    assert encode_event(SignedEvent.from_json_obj(EV)) == (
        '["EVENT",' + json.dumps(EV, separators=(",", ":"), ensure_ascii=False) + "]")
    assert "héllo" in encode_event(SignedEvent.from_json_obj(EV))
    assert json.loads(encode_req("q0", [{"kinds": [9]}, {"ids": [ID]}])) == ["REQ", "q0", {"kinds": [9]}, {"ids": [ID]}]
    assert encode_close("q0") == '["CLOSE","q0"]'
    auth = dict(EV, kind=22242)
    assert json.loads(encode_auth(SignedEvent.from_json_obj(auth))) == ["AUTH", auth]
    with pytest.raises(ValueError):
        encode_auth(SignedEvent.from_json_obj(EV))
    with pytest.raises(ValueError):
        encode_req("q0", [])
    assert subscription_id(0) != subscription_id(1)


@pytest.mark.parametrize(
    ("url", "host", "port", "resource", "secure"),
    [
        ("ws://127.0.0.1:7777", "127.0.0.1", 7777, "/", False),
        ("ws://localhost/relay?x=1", "localhost", 80, "/relay?x=1", False),
        ("ws://[::1]:9", "::1", 9, "/", False),
        ("wss://relay.example.com", "relay.example.com", 443, "/", True),
        ("wss://relay.example.com:8443/r", "relay.example.com", 8443, "/r", True),
    ],
)
def test_relay_url_accepted(url: str, host: str, port: int, resource: str, secure: bool) -> None:
    parsed = check_relay_url(url)
    assert (parsed.text, parsed.host, parsed.port, parsed.resource, parsed.secure) == (
        url, host, port, resource, secure,
    )


@pytest.mark.parametrize(
    "url",
    ["ws://relay.example.com", "ws://192.168.1.2", "http://127.0.0.1", "wss://", "", "wss://u:p@h",
     "wss://h:99999", "wss://h#frag", "ws://127.0.0.1 "],
)
def test_relay_url_refused(url: str) -> None:
    with pytest.raises(ValueError):
        check_relay_url(url)


def test_encode_req_refuses_a_subscription_id_nip01_does_not_allow() -> None:
    # NIP-01: 1..64 characters. Ours are q<n>; a bug making one otherwise must not reach
    # the relay (which would CLOSE it or drop the connection).
    with pytest.raises(ValueError):
        encode_req("", [{"kinds": [9]}])
    with pytest.raises(ValueError):
        encode_req("q" * 65, [{"kinds": [9]}])
    assert encode_req("q" * 64, [{"kinds": [9]}]).startswith('["REQ","' + "q" * 64)


def test_a_prefix_needs_its_colon_and_tolerates_spaces() -> None:
    # NIP-01's machine prefix is the word *and* the colon: a bare "auth-required" (or
    # "duplicate") is human text, and must not make us AUTH (or report a duplicate).
    assert machine_prefix("auth-required") is None
    assert machine_prefix("duplicate") is None
    assert machine_prefix(" duplicate : have it") is Prefix.DUPLICATE


@pytest.mark.parametrize("blank", ["", "   ", "\x00\x1b\r\n", "\u2028\u202e \t"])
def test_a_blank_relay_reason_is_quoted_as_no_reason_given(blank: str) -> None:
    # An agent's answer and the operator's line say "no reason given", never end in a
    # run of blanks or in nothing.
    assert quote_reason(blank) == "no reason given"


def test_a_quote_is_stripped_and_keeps_its_prefix() -> None:
    quoted = quote_reason(" \x00\r\n restricted: not a member\u2028 \r\n")
    assert quoted == "restricted: not a member"
    assert machine_prefix(quoted) is machine_prefix("restricted: not a member")


def test_a_quote_reads_only_the_head_of_a_frame_long_reason() -> None:
    # Leading blanks are room for (a scan of 4 x MAX_REASON_CHARS), no more: past it the
    # text is not read at all (a pass over a 1 Mi-character message costs the event loop
    # ~0.1 s), so a reason whose head is blank is "no reason given".
    assert quote_reason(" " * (2 * MAX_REASON_CHARS) + "y" * 5 * MAX_REASON_CHARS) == (
        "y" * MAX_REASON_CHARS)
    assert quote_reason(" " * (4 * MAX_REASON_CHARS) + "x" * 1_000_000) == "no reason given"
