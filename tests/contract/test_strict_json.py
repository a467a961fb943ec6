"""The strict JSON reader, seen through read_request: which bodies are uncorrelated
(syntax), which are correlated invalid_request (strictness), and the pointer named; and,
where a field's own rule would give the same pointer, the reader's rule (parse_json)."""

from __future__ import annotations

import time

import pytest

from buzzwire.contract import (
    ContractError, ErrorCode, Rule, parse_json, parse_response, read_request,
)
from tests.contract.vectors import (
    CHANNEL, REQUEST_ID, VALID_OUTCOMES, Pairs, body, dump, envelope,
)

VALID = body(envelope())


def uncorrelated(raw: bytes) -> None:
    reading = read_request(raw)
    assert reading.request_id is None and reading.request is None
    assert reading.error is not None and reading.error.code is ErrorCode.INVALID_REQUEST


def invalid_at(raw: bytes, pointer: str) -> None:
    reading = read_request(raw)
    assert reading.request_id == REQUEST_ID
    assert reading.error is not None, "expected a fault"
    assert (reading.error.code, reading.error.pointer) == (ErrorCode.INVALID_REQUEST, pointer)


def test_valid_body_reads() -> None:
    reading = read_request(VALID)
    assert reading.request is not None and reading.error is None


@pytest.mark.parametrize("raw", [
    b"\xff" + VALID,                                   # invalid UTF-8 byte
    VALID.replace(b"On it.", b"On \xc3("),              # truncated multibyte sequence
    VALID.replace(b"On it.", b"\xed\xa0\x80"),          # a surrogate encoded in UTF-8 (CESU)
    VALID.replace(b"On it.", b"\xc0\xae"),              # overlong encoding
    b"\xef\xbb\xbf" + VALID,                            # a BOM is not JSON whitespace
    VALID.replace(b'"content"', b"'content'"),
    VALID.replace(b'"On it."', b"NaN"),
    VALID.replace(b'"On it."', b"Infinity"),
    VALID.replace(b'"On it."', b"-Infinity"),
    VALID.replace(b'"On it."', b'"a\x01b"'),            # raw control character in a string
    VALID[:-1] + b",}",                                 # trailing comma
    b"/*c*/" + VALID,
    b"",
    b"   ",
])
def test_syntax_faults_are_uncorrelated(raw: bytes) -> None:
    uncorrelated(raw)


@pytest.mark.parametrize("junk", [b"x", b"{}", b"\x00", b" 1", b"\n]"])
def test_trailing_bytes_are_refused(junk: bytes) -> None:
    uncorrelated(VALID + junk)


def test_trailing_whitespace_is_json() -> None:
    assert read_request(b" \n\t" + VALID + b"\r\n ").request is not None


def test_every_strict_prefix_is_uncorrelated() -> None:
    # The reader takes the body whole; any cut leaves no readable document.
    for end in range(len(VALID) - 1):
        uncorrelated(VALID[:end])


@pytest.mark.parametrize("top", [b"[]", b"1", b'"x"', b"true", b"null", b"[" + VALID + b"]"])
def test_top_level_must_be_an_object(top: bytes) -> None:
    uncorrelated(top)


def test_ten_thousand_deep_is_refused_quickly() -> None:
    for opener, closer in ((b"[", b"]"), (b'{"a":', b"}")):
        raw = VALID[:-1] + b',"deep":' + opener * 10_000 + closer * 10_000 + b"}"
        start = time.perf_counter()
        uncorrelated(raw)
        uncorrelated(opener * 10_000)  # unterminated, too
        assert time.perf_counter() - start < 0.5


def test_brackets_inside_strings_do_not_count_as_nesting() -> None:
    args = {"channelId": "5df7dfa8-e919-43df-8efd-f1dcb8af7071", "content": "[{" * 5000}
    assert read_request(body(envelope("message.post", args))).request is not None


def test_nesting_at_the_bound_is_readable_and_one_more_is_not() -> None:
    from buzzwire.contract import MAX_NESTING
    # top-level object is level 1; "x" nests MAX_NESTING - 1 more levels -> at the bound.
    at = VALID[:-1] + b',"x":' + b"[" * (MAX_NESTING - 1) + b"]" * (MAX_NESTING - 1) + b"}"
    invalid_at(at, "/x")  # readable: the fault is only the unknown member
    over = VALID[:-1] + b',"x":' + b"[" * MAX_NESTING + b"]" * MAX_NESTING + b"}"
    uncorrelated(over)


def test_lone_surrogates_are_named() -> None:
    invalid_at(VALID.replace(b"On it.", b"\\ud800"), "/args/content")
    invalid_at(VALID.replace(b"On it.", b"x\\udfffx"), "/args/content")
    invalid_at(VALID.replace(b'"content"', b'"\\ud800"'), "/args")  # in a member name


def test_surrogate_pair_escape_is_one_scalar() -> None:
    reading = read_request(VALID.replace(b"On it.", b"\\ud83d\\ude00"))
    assert reading.request is not None
    assert reading.request.args.content == "\U0001F600"  # type: ignore[union-attr]


@pytest.mark.parametrize(("member", "number"), [
    ("protocolVersion", "1.0"), ("protocolVersion", "1e0"), ("protocolVersion", "1E+0"),
    ("actionVersion", "1.0"), ("actionVersion", "10e-1"),
])
def test_non_integers_are_refused(member: str, number: str) -> None:
    raw = VALID.replace(f'"{member}":1'.encode(), f'"{member}":{number}'.encode())
    assert raw != VALID
    invalid_at(raw, f"/{member}")


def test_booleans_are_not_integers() -> None:
    invalid_at(VALID.replace(b'"protocolVersion":1', b'"protocolVersion":true'), "/protocolVersion")
    raw = body(envelope("channel.read", {"channelId": "5df7dfa8-e919-43df-8efd-f1dcb8af7071", "limit": True}))
    invalid_at(raw, "/args/limit")


@pytest.mark.parametrize("digits", [
    "9223372036854775808",  # 2**63: one past signed 64 bits
    "-9223372036854775809",
    "99999999999999999999",
    "9" * 5000,             # beyond CPython's int-from-string digit limit
])
def test_out_of_range_integers_are_refused(digits: str) -> None:
    invalid_at(VALID.replace(b'"protocolVersion":1', f'"protocolVersion":{digits}'.encode()),
               "/protocolVersion")


def test_largest_integer_is_read_then_judged_by_its_field() -> None:
    raw = VALID.replace(b'"protocolVersion":1', b'"protocolVersion":9223372036854775807')
    reading = read_request(raw)
    # The reader takes it (it fits 64 bits); the field refuses it: a version is a u16 (NIP-BA).
    assert reading.error is not None and reading.error.code is ErrorCode.INVALID_REQUEST
    assert reading.error.pointer == "/protocolVersion"


#: The reader's integer range: signed 64 bits (NIP-BA "Wire and normalization").
I64_MAX, I64_MIN = 2**63 - 1, -(2**63)


@pytest.mark.parametrize("number", [I64_MAX, I64_MIN, 10**18, -(10**18)])
def test_every_signed_64_bit_integer_is_read(number: int) -> None:
    # Both ends of the range are data, not faults: the tests above can only show the top end
    # through protocolVersion, whose own u16 rule would refuse it anyway.
    assert parse_json(f'{{"n":{number}}}'.encode()) == ({"n": number}, None)


@pytest.mark.parametrize("digits", [
    "9223372036854775808",   # 2**63: 19 digits, past the short-literal path's 18
    "9999999999999999999",
    "-9223372036854775809",  # one below -(2**63)
])
def test_one_past_signed_64_bits_is_named_as_such(digits: str) -> None:
    # The rule itself, not just the pointer: a value no i64 holds never reaches a field.
    assert parse_json(f'{{"n":{digits}}}'.encode())[1] == ("/n", Rule.INTEGER_PAST_64_BITS)


def test_a_created_at_past_64_bits_is_no_response() -> None:
    # createdAt takes 0..2**63 - 1, so only the reader's 64-bit rule keeps a host's 2**63
    # from a client as a timestamp no signed 64-bit field can hold.
    wire = {"type": "broker_result", "protocolVersion": 1, "requestId": REQUEST_ID,
            "status": "succeeded", "action": "message.post"}
    outcome = VALID_OUTCOMES["message.post"]
    at_max = {**wire, "outcome": {**outcome, "createdAt": I64_MAX}}
    assert parse_response(body(at_max)).outcome.created_at == I64_MAX  # type: ignore[union-attr]
    with pytest.raises(ContractError) as err:
        parse_response(body({**wire, "outcome": {**outcome, "createdAt": I64_MAX + 1}}))
    assert (err.value.pointer, err.value.rule) == ("/outcome/createdAt", Rule.INTEGER_PAST_64_BITS)


@pytest.mark.parametrize("escape", [b"\\ud800", b"\\udbff", b"\\udc00", b"\\udfff", b"\\uDC00"])
def test_a_lone_surrogate_of_either_half_is_named_by_its_rule(escape: bytes) -> None:
    # A field's checker refuses a surrogate at the same pointer, so only the rule shows the
    # reader found it: its search must cover the low halves (\udc00-\udfff), in either case.
    raw = body(envelope("typing.set", {"channelId": CHANNEL}))
    reading = read_request(raw.replace(CHANNEL.encode(), CHANNEL.encode() + escape))
    assert reading.error is not None
    assert (reading.error.pointer, reading.error.rule) == ("/args/channelId", Rule.LONE_SURROGATE)


def test_null_anywhere_is_named() -> None:
    env = envelope("agents.update", {"target": {"pubkey": None}, "displayName": "x"})
    invalid_at(body(env), "/args/target/pubkey")
    invalid_at(body(envelope(args={**envelope()["args"], "mentions": [None]})), "/args/mentions/0")


def test_null_spelled_inside_a_string_is_text() -> None:
    env = envelope(args={**envelope()["args"], "content": "null"})
    assert read_request(body(env)).request is not None


def test_repeated_keys_at_every_depth() -> None:
    base = envelope("agents.update")
    top = Pairs([*base.items(), ("type", "broker_request")])
    invalid_at(body(top), "/type")
    args = Pairs([*base["args"].items(), ("displayName", "again")])
    invalid_at(body({**base, "args": args}), "/args/displayName")
    target = Pairs([("pubkey", base["args"]["target"]["pubkey"])] * 2)
    invalid_at(body({**base, "args": {**base["args"], "target": target}}), "/args/target/pubkey")


def test_first_fault_in_document_order() -> None:
    args = {"channelId": None, "content": None}
    invalid_at(body(envelope("message.post", args)), "/args/channelId")


def test_pointer_escapes_slash_and_tilde() -> None:
    raw = body({**envelope(), "a/b~c": 1})
    invalid_at(raw, "/a~1b~0c")


def test_dump_helper_writes_repeats() -> None:
    assert dump(Pairs([("a", 1), ("a", 2)])) == '{"a":1,"a":2}'
