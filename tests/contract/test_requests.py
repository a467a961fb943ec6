"""Request envelopes and the nine argument shapes, table-driven from spec §Request and
§Operations. Tests assert codes, pointers and values, never message text."""

from __future__ import annotations

import dataclasses
import itertools
import re
from typing import Any

import coincurve
import pytest

from buzzwire.contract import (
    ACTIONS, DEFAULT_LIMIT, MAX_MEMORY_BODY_BYTES, RESERVED_NAMES, AgentTarget,
    ChannelReadArgs, ContractError, ErrorCode, MessagePostArgs, ProfileSetArgs, Request, Rule,
    build_request, encode_request, normalize_channel_id, read_request,
)
from tests.contract.vectors import (
    CHANNEL, EVENT_ID, PK1, PK2, PK3, REQUEST_ID, VALID_ARGS, Pairs, body, envelope,
)

I = ErrorCode.INVALID_REQUEST


def verdict(env: Any) -> tuple[ErrorCode, str] | None:
    reading = read_request(body(env))
    assert reading.request_id == REQUEST_ID, "expected a correlated reading"
    return None if reading.error is None else (reading.error.code, reading.error.pointer)


def args_of(action: str, **members: Any) -> Any:
    reading = read_request(body(envelope(action, members)))
    assert reading.error is None, reading.error
    assert reading.request is not None
    return reading.request.args


def args_fault(action: str, members: dict[str, Any]) -> str:
    reading = read_request(body(envelope(action, members)))
    assert reading.error is not None and reading.error.code is I, reading
    return reading.error.pointer


# --- every action: valid, round trip, and the frozen bytes are a fixed point -------------

@pytest.mark.parametrize("action", sorted(ACTIONS))
def test_valid_args_read_and_round_trip(action: str) -> None:
    reading = read_request(body(envelope(action)))
    assert reading.request is not None, reading.error
    request = reading.request
    assert type(request.args) is ACTIONS[action].args_type
    frozen = encode_request(request)
    again = read_request(frozen)
    assert again.request == request
    assert encode_request(again.request) == frozen  # I3: one frozen form
    assert build_request(action, VALID_ARGS[action], request_id=REQUEST_ID) == request


@pytest.mark.parametrize("action", sorted(ACTIONS))
def test_reader_output_passes_public_construction(action: str) -> None:
    # The reader builds without __init__; the public constructor must accept the same values.
    args = read_request(body(envelope(action))).request.args  # type: ignore[union-attr]
    assert dataclasses.replace(args) == args


# --- envelope ------------------------------------------------------------------------------

def test_reserved_names_never_resolve() -> None:
    assert not RESERVED_NAMES & set(ACTIONS)
    for name in sorted(RESERVED_NAMES) + ["Message.Post", " message.post", "Presence.Set", "presence.get"]:
        assert verdict(envelope(action=name)) == (ErrorCode.UNKNOWN_ACTION, "/action")
        with pytest.raises(ContractError) as err:
            build_request(name, {}, request_id=REQUEST_ID)
        assert err.value.code is ErrorCode.UNKNOWN_ACTION


@pytest.mark.parametrize(("over", "expected"), [
    ({"type": "broker_result"}, (I, "/type")),
    ({"protocolVersion": 2}, (ErrorCode.UNSUPPORTED_PROTOCOL_VERSION, "/protocolVersion")),
    ({"protocolVersion": 0}, (ErrorCode.UNSUPPORTED_PROTOCOL_VERSION, "/protocolVersion")),
    ({"protocolVersion": "1"}, (I, "/protocolVersion")),
    ({"actionVersion": 2}, (ErrorCode.UNSUPPORTED_ACTION_VERSION, "/actionVersion")),
    ({"actionVersion": "1"}, (I, "/actionVersion")),
    ({"action": 5}, (I, "/action")),
    ({"args": []}, (I, "/args")),
    ({"args": "x"}, (I, "/args")),
    ({"extra": 1}, (I, "/extra")),
])
def test_envelope_faults(over: dict[str, Any], expected: tuple[ErrorCode, str]) -> None:
    assert verdict(envelope(**over)) == expected


@pytest.mark.parametrize("member", ["type", "protocolVersion", "actionVersion", "action", "args"])
def test_every_envelope_member_is_required(member: str) -> None:
    env = envelope()
    del env[member]
    assert verdict(env) == (I, f"/{member}")


@pytest.mark.parametrize("member", ["type", "protocolVersion", "actionVersion", "action", "args"])
def test_null_and_repeat_at_every_envelope_member(member: str) -> None:
    assert verdict({**envelope(), member: None}) == (I, f"/{member}")
    env = envelope()
    assert verdict(Pairs([*env.items(), (member, env[member])])) == (I, f"/{member}")


def test_precedence_order() -> None:
    # strictness anywhere beats every envelope rule
    env = envelope(protocolVersion=2, action="sign", args={"x": None})
    assert verdict(env) == (I, "/args/x")
    # protocolVersion beats unknown members and the action
    assert verdict(envelope(protocolVersion=2, action="sign", extra=1)) == (
        ErrorCode.UNSUPPORTED_PROTOCOL_VERSION, "/protocolVersion")
    # unknown envelope member beats the action
    assert verdict(envelope(action="sign", extra=1)) == (I, "/extra")
    # action beats actionVersion and args
    assert verdict(envelope(action="sign", actionVersion=2, args={})) == (ErrorCode.UNKNOWN_ACTION, "/action")
    # actionVersion beats args
    assert verdict(envelope(actionVersion=2, args={})) == (ErrorCode.UNSUPPORTED_ACTION_VERSION, "/actionVersion")


@pytest.mark.parametrize("request_id", [
    None, 5, True, "", " a", "a b", "a\tb", "é", "x" * 129, ["a"], {"a": "b"},
    "a\x7fb",  # DEL may stand raw in a JSON string, but it is a control, not visible ASCII
])
def test_unusable_request_id_is_uncorrelated(request_id: Any) -> None:
    reading = read_request(body(envelope(requestId=request_id)))
    assert reading.request_id is None and reading.error is not None
    assert reading.error.pointer == "/requestId"


def test_missing_or_repeated_request_id_is_uncorrelated() -> None:
    env = envelope()
    del env["requestId"]
    assert read_request(body(env)).request_id is None
    repeated = Pairs([*envelope().items(), ("requestId", REQUEST_ID)])
    assert read_request(body(repeated)).request_id is None


def test_request_id_bounds() -> None:
    for rid in ("!", "~" * 128, "".join(chr(c) for c in range(0x21, 0x7F))[:128]):
        assert read_request(body(envelope(requestId=rid))).request_id == rid


# --- strict members in every args shape and the nested target ------------------------------

@pytest.mark.parametrize("action", sorted(ACTIONS))
def test_extra_null_repeat_and_missing_in_args(action: str) -> None:
    valid = VALID_ARGS[action]
    assert args_fault(action, {**valid, "extra": 1}) == "/args/extra"
    assert args_fault(action, {**valid, "requester": PK1}) == "/args/requester"  # B2
    for member in valid:
        assert args_fault(action, {**valid, member: None}) == f"/args/{member}"
        reading = read_request(body(envelope(action, Pairs([*valid.items(), (member, valid[member])]))))
        assert reading.error is not None and reading.error.pointer == f"/args/{member}"
    for member in ACTIONS[action].arg_members.required:
        partial = {k: v for k, v in valid.items() if k != member}
        if action == "agents.delete":
            assert args_fault(action, partial) == "/args/target"
        else:
            assert args_fault(action, partial) == f"/args/{member}"


def test_target_is_strict_and_exactly_one() -> None:
    for target, pointer in [
        ({"pubkey": PK1, "extra": 1}, "/args/target/extra"),
        ({"pubkey": PK1, "name": "a"}, "/args/target"),
        ({}, "/args/target"),
        ([PK1], "/args/target"),
        ({"pubkey": "f" * 64}, "/args/target/pubkey"),
        ({"name": "  "}, "/args/target/name"),
    ]:
        assert args_fault("agents.delete", {"target": target}) == pointer
    assert args_of("agents.delete", target={"name": " Scout "}).target == AgentTarget(name="Scout")
    assert args_of("agents.delete", target={"pubkey": PK1.upper()}).target == AgentTarget(pubkey=PK1)


# --- identities ------------------------------------------------------------------------------

UUID_HEX = CHANNEL.replace("-", "")


@pytest.mark.parametrize("spelling", [
    # NIP-BA's spellings; tests/contract/test_text_rules.py holds the whole table.
    CHANNEL, CHANNEL.upper(), UUID_HEX, UUID_HEX.upper(), "{" + CHANNEL + "}",
    "urn:uuid:" + CHANNEL, "urn:uuid:" + CHANNEL.upper(), "  " + CHANNEL + "\n",
    "5DF7dfa8-E919-43df-8EFD-f1dcb8af7071",
])
def test_every_uuid_spelling_normalizes(spelling: str) -> None:
    assert normalize_channel_id(spelling) == CHANNEL
    assert args_of("storage.address", slug="core") is not None
    assert args_of("channel.read", channelId=spelling).channel_id == CHANNEL


@pytest.mark.parametrize("spelling", [
    "", UUID_HEX[:-1], UUID_HEX + "0", "5df7dfa8e919-43df-8efd-f1dcb8af7071",
    "5df7-dfa8e919-43df-8efd-f1dcb8af7071", "{urn:uuid:" + CHANNEL + "}", "urn:uuid:{" + CHANNEL + "}",
    "{" + CHANNEL, CHANNEL.replace("5", "g"), "uuid:" + CHANNEL,
    "{" + UUID_HEX + "}", "urn:uuid:" + UUID_HEX, "URN:UUID:" + CHANNEL.upper(),
])
def test_illegal_uuid_spellings(spelling: str) -> None:
    assert normalize_channel_id(spelling) is None
    assert args_fault("channel.read", {"channelId": spelling}) == "/args/channelId"


def test_hex64_is_lowercased_and_pubkeys_must_be_points() -> None:
    args = args_of("message.reply", channelId=CHANNEL, replyToEventId=EVENT_ID.upper(),
                   content="x", mentions=[PK1.upper()])
    assert (args.reply_to_event_id, args.mentions) == (EVENT_ID, (PK1,))
    for bad in ("f" * 64, "0" * 63, "g" * 64, PK1 + "00"):
        assert args_fault("message.post", {"channelId": CHANNEL, "content": "x", "mentions": [bad]}) == "/args/mentions/0"
    # x >= p and x with no y: neither is a point
    assert args_fault("agents.delete", {"target": {"pubkey": "f" * 64}}) == "/args/target/pubkey"


def _pubkeys(n: int) -> list[str]:
    return [coincurve.PrivateKey.from_int(i).public_key.format()[1:].hex() for i in range(1, n + 1)]


def test_mentions_limit_dedupe_and_empty() -> None:
    keys = _pubkeys(51)
    post = {"channelId": CHANNEL, "content": "x"}
    assert len(args_of("message.post", **post, mentions=keys[:50]).mentions) == 50
    assert args_fault("message.post", {**post, "mentions": keys}) == "/args/mentions"
    # repeated mentions: normalized, kept once at the first position, counted as sent
    args = args_of("message.post", **post, mentions=[PK2, PK1, PK2.upper(), PK3])
    assert args.mentions == (PK2, PK1, PK3)
    assert args_fault("message.post", {**post, "mentions": [PK1] * 51}) == "/args/mentions"
    assert args_fault("message.post", {**post, "mentions": []}) == "/args/mentions"  # I6
    assert args_fault("message.post", {**post, "mentions": PK1}) == "/args/mentions"


# --- limits at max and max + 1, characters vs bytes -------------------------------------

EMOJI, CJK = "\U0001F600", "\u4e2d"  # 4 and 3 UTF-8 bytes, one scalar value each

CHAR_LIMITS = [  # (action, other members, member, limit in characters)
    ("profile.set", {}, "displayName", 120),
    ("profile.set", {}, "about", 2000),
    ("profile.set", {}, "picture", 300),
    ("agents.create", {"channelId": CHANNEL, "displayName": "a", "systemPrompt": "b"}, "systemPrompt", 20_000),
    ("agents.create", {"channelId": CHANNEL, "displayName": "a", "systemPrompt": "b"}, "displayName", 120),
    ("agents.create", {"channelId": CHANNEL, "displayName": "a", "systemPrompt": "b"}, "runtime", 300),
    ("agents.create", {"channelId": CHANNEL, "displayName": "a", "systemPrompt": "b"}, "provider", 300),
    ("agents.create", {"channelId": CHANNEL, "displayName": "a", "systemPrompt": "b"}, "model", 300),
    ("agents.update", {"target": {"name": "a"}}, "systemPrompt", 20_000),
    ("reaction.add", {"channelId": CHANNEL, "targetEventId": EVENT_ID}, "reaction", 66),
]


@pytest.mark.parametrize(("action", "others", "member", "limit"), CHAR_LIMITS)
@pytest.mark.parametrize("char", ["a", EMOJI, CJK])
def test_character_limits(action: str, others: dict[str, Any], member: str, limit: int, char: str) -> None:
    at = char * limit
    args = args_of(action, **{**others, member: at})
    assert at in dataclasses.astuple(args)
    assert args_fault(action, {**others, member: char * (limit + 1)}) == f"/args/{member}"
    # surrounding whitespace is trimmed before counting
    assert at in dataclasses.astuple(args_of(action, **{**others, member: f"  {at}\n"}))


def test_target_name_limit() -> None:
    assert args_of("agents.delete", target={"name": EMOJI * 120}).target.name == EMOJI * 120
    assert args_fault("agents.delete", {"target": {"name": EMOJI * 121}}) == "/args/target/name"


@pytest.mark.parametrize(("fill", "width"), [("a", 1), ("é", 2), (CJK, 3), (EMOJI, 4)])
def test_content_limit_counts_bytes(fill: str, width: int) -> None:
    count = 65536 // width
    content = fill * count + "a" * (65536 - count * width)  # exactly 65536 bytes
    assert len(content.encode()) == 65536
    post = {"channelId": CHANNEL}
    assert args_of("message.post", **post, content=content).content == content
    assert args_fault("message.post", {**post, "content": content + "a"}) == "/args/content"


def test_content_is_exact_but_not_blank() -> None:
    post = {"channelId": CHANNEL}
    assert args_of("message.post", **post, content="  hi \n").content == "  hi \n"
    for blank in ("", " ", "\n\t ", "\u3000"):
        assert args_fault("message.post", {**post, "content": blank}) == "/args/content"


def test_trimmed_fields_cannot_be_blank() -> None:
    for member in ("displayName", "about", "picture"):
        assert args_fault("profile.set", {member: "   "}) == f"/args/{member}"


def test_cursor_is_opaque_and_bounded() -> None:
    read = {"channelId": CHANNEL}
    assert args_of("channel.read", **read, cursor="~" * 256).cursor == "~" * 256
    # DEL ("a\x7f") is a control, not the visible ASCII a cursor is made of.
    for bad in ("~" * 257, "", " abc", "abc ", "a b", "é", "a\n", "a\x7f"):
        assert args_fault("channel.read", {**read, "cursor": bad}) == "/args/cursor"


def test_limit_range_and_default() -> None:
    read = {"channelId": CHANNEL}
    assert args_of("channel.read", **read).effective_limit == DEFAULT_LIMIT == 100
    assert args_of("channel.read", **read).limit is None
    for good in (1, 500):
        assert args_of("channel.read", **read, limit=good).effective_limit == good
    for bad in (0, 501, -1, True, "5", 2**63 - 1):
        assert args_fault("channel.read", {**read, "limit": bad}) == "/args/limit"


def test_mentions_only_is_boolean_and_false_by_default() -> None:
    read = {"channelId": CHANNEL}
    assert args_of("channel.read", **read).mentions_only is False
    assert args_of("channel.read", **read, mentionsOnly=False).mentions_only is False
    for bad in (1, "true", 0):
        assert args_fault("channel.read", {**read, "mentionsOnly": bad}) == "/args/mentionsOnly"


@pytest.mark.parametrize(("action", "member", "value"), [
    ("profile.set", "picture", "not a url at all"),
    ("profile.set", "picture", "javascript:alert(1)"),
    ("reaction.add", "reaction", "lgtm"),
    ("reaction.add", "reaction", ":no-such-shortcode-anywhere:"),
    ("reaction.add", "reaction", "+"),
])
def test_picture_and_reaction_are_bounded_text_not_a_url_or_an_emoji(
        action: str, member: str, value: str) -> None:
    # docs/protocol.md profile.set and reaction.add: the host checks length and the
    # one-line character rule only (NIP-BA: picture is "a bounded string, not a promise
    # that its URL is safe to fetch"; a host MAY restrict reactions, this one does not).
    args = {**VALID_ARGS[action], member: value}
    assert getattr(args_of(action, **args), member) == value


def test_mentions_only_is_a_boolean_at_construction_too() -> None:
    # 0 == False in Python, and False is the absent value: construction must still refuse
    # what the wire refuses, or a built request would say something no reader accepts.
    assert ChannelReadArgs(channel_id=CHANNEL, mentions_only=False).mentions_only is False
    for not_a_bool in (0, 0.0):
        with pytest.raises(ValueError):
            ChannelReadArgs(channel_id=CHANNEL, mentions_only=not_a_bool)  # type: ignore[arg-type]


@pytest.mark.parametrize("slug", [
    "core", "mem/a", "mem/slice-c", "mem/notes/2026-05-12", "mem/a_b/c-d/0",
    "mem/" + "a" * 64, "mem/" + "/".join(["a" * 63] * 3) + "/" + "b" * 58, " core ",
])
def test_legal_slugs(slug: str) -> None:
    assert len(slug.strip()) <= 255
    assert args_of("storage.address", slug=slug).slug == slug.strip()


#: (slug, the rule its refusal names): the agent is told which part of NIP-AE's grammar it
#: broke, so a 65-character segment is not reported as a slug over 255 bytes.
ILLEGAL_SLUGS = [
    ("", Rule.SLUG), ("Core", Rule.SLUG), ("mem", Rule.SLUG), ("mem/", Rule.SLUG),
    ("mem/a/", Rule.SLUG), ("mem//a", Rule.SLUG), ("core/x", Rule.SLUG),
    ("mem/a//b", Rule.SLUG), ("mem/notes//x/y", Rule.SLUG),  # an empty segment after the first
    ("mem/-a", Rule.SLUG_SEGMENT_START), ("mem/_a", Rule.SLUG_SEGMENT_START),
    ("mem/ok/-a", Rule.SLUG_SEGMENT_START),
    ("mem/A", Rule.SLUG_CHARACTER), ("mem/a.b", Rule.SLUG_CHARACTER),
    ("mem/é", Rule.SLUG_CHARACTER), ("mem/a b", Rule.SLUG_CHARACTER),
    ("mem/_A", Rule.SLUG_CHARACTER),  # two faults: the character is told first
    ("mem/" + "a" * 65, Rule.SLUG_SEGMENT_LONG),
    ("mem/ok/" + "a" * 65, Rule.SLUG_SEGMENT_LONG),
    ("mem/" + "/".join(["a" * 63] * 4), Rule.BYTES),
]


@pytest.mark.parametrize(("slug", "rule"), ILLEGAL_SLUGS)
def test_illegal_slugs(slug: str, rule: Rule) -> None:
    reading = read_request(body(envelope("storage.address", {"slug": slug})))
    assert reading.error is not None
    assert (reading.error.code, reading.error.pointer, reading.error.rule) == (
        I, "/args/slug", rule)


def test_slug_byte_bound_exactly() -> None:
    at = "mem/" + "/".join(["a" * 50] * 5)  # 4 + 5*50 + 4 = 258 > 255
    assert args_fault("storage.address", {"slug": at}) == "/args/slug"
    ok = "mem/" + "/".join(["a" * 50] * 4) + "/" + "b" * 47  # 4 + 203 + 1 + 47 = 255
    assert len(ok) == 255 and args_of("storage.address", slug=ok).slug == ok
    over = read_request(body(envelope("storage.address", {"slug": ok + "b"}))).error
    assert over is not None and (over.pointer, over.rule) == ("/args/slug", Rule.BYTES)


#: buzz-on-the-relay.md "Encrypted memory address", verbatim: the one grammar.
SPEC_SLUG = re.compile(r"^mem/[a-z0-9][a-z0-9_-]{0,63}(/[a-z0-9][a-z0-9_-]{0,63})*$")


def test_slug_acceptance_is_the_specs_grammar_and_every_refusal_names_a_part_of_it() -> None:
    # Every string over a small alphabet, up to 5 characters, behind "mem/", and a few
    # around each length bound: accepted exactly when the spec's grammar (and its 255
    # bytes) says so, and each refusal names the part that fails.
    alphabet = "a0_-/A."
    tails = ["".join(t) for n in range(6) for t in itertools.product(alphabet, repeat=n)]
    tails += [s * n for s in ("a", "a/", "ab/") for n in (63, 64, 65, 84, 85, 86, 127, 128)]
    for tail in tails:
        slug = "mem/" + tail
        reading = read_request(body(envelope("storage.address", {"slug": slug})))
        legal = SPEC_SLUG.fullmatch(slug) is not None and len(slug.encode()) <= 255
        assert (reading.error is None) is legal, slug
        if reading.error is None:
            continue
        segments = tail.split("/")
        expected = (Rule.SLUG if "" in segments
                    else Rule.SLUG_CHARACTER if re.search(r"[^a-z0-9_/-]", tail)
                    else Rule.SLUG_SEGMENT_START if any(s[0] in "_-" for s in segments)
                    else Rule.SLUG_SEGMENT_LONG if any(len(s) > 64 for s in segments)
                    else Rule.BYTES)
        assert reading.error.rule is expected, slug


@pytest.mark.parametrize("char", ["a", "é"])
def test_a_memory_value_over_its_own_bound_is_refused_at_the_value(char: str) -> None:
    # The value's own bound (65,535 bytes, NIP-BA's body) names the value; the whole-body
    # rule would also refuse it, but at /args, so only the pointer shows the member's bound.
    over = char * (MAX_MEMORY_BODY_BYTES // len(char.encode()) + 1)
    assert args_fault("storage.put", {"slug": "mem/x", "value": over}) == "/args/value"


def test_at_least_one_rules() -> None:
    assert args_fault("profile.set", {}) == "/args"
    assert args_fault("agents.update", {"target": {"name": "a"}}) == "/args"
    assert args_of("agents.update", target={"name": "a"}, model="m").model == "m"


def test_respond_to() -> None:
    create = {"channelId": CHANNEL, "displayName": "a", "systemPrompt": "b"}
    assert args_of("agents.create", **create).respond_to is None
    assert args_of("agents.create", **create, respondTo=" anyone ").respond_to == "anyone"
    for bad in ("allow-list", "Anyone", "", 1):
        assert args_fault("agents.create", {**create, "respondTo": bad}) == "/args/respondTo"


# --- construction validates; build_request is the wire rule on a mapping ---------------------

def test_construction_refuses_invalid_or_unnormalized_values() -> None:
    MessagePostArgs(channel_id=CHANNEL, content="x", mentions=(PK1,))
    for bad in (
        {"channel_id": CHANNEL.upper(), "content": "x"},
        {"channel_id": CHANNEL, "content": " "},
        {"channel_id": CHANNEL, "content": "x", "mentions": [PK1]},       # list, not tuple
        {"channel_id": CHANNEL, "content": "x", "mentions": (PK1, PK1)},  # not de-duplicated
        {"channel_id": CHANNEL, "content": "x", "mentions": ("f" * 64,)},
        {"channel_id": CHANNEL, "content": "\ud800"},
    ):
        with pytest.raises(ValueError):
            MessagePostArgs(**bad)
    with pytest.raises(ValueError):
        AgentTarget(pubkey=PK1, name="a")
    with pytest.raises(TypeError):
        MessagePostArgs(CHANNEL, "x")  # type: ignore[misc]  # keyword-only
    args = MessagePostArgs(channel_id=CHANNEL, content="x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.content = "y"  # type: ignore[misc]


@pytest.mark.parametrize(("args", "pointer"), [
    ({"channelId": CHANNEL, "content": None}, "/args/content"),
    ({"channelId": CHANNEL, "content": float("nan")}, "/args"),
    ({"channelId": CHANNEL, "content": "x", "mentions": ()}, "/args/mentions"),
    ({"channelId": CHANNEL, "content": "\ud800"}, "/args/content"),
    ({"channelId": CHANNEL, "content": object()}, "/args"),
    ({"channelId": CHANNEL, "content": 1.5}, "/args/content"),
])
def test_build_request_applies_the_wire_rules(args: dict[str, Any], pointer: str) -> None:
    with pytest.raises(ContractError) as err:
        build_request("message.post", args, request_id=REQUEST_ID)
    assert (err.value.code, err.value.pointer) == (I, pointer)


@pytest.mark.parametrize("text", ["Ada\ud800", "Ada\udfff"])
@pytest.mark.parametrize("member", ["display_name", "about"])
def test_construction_refuses_a_lone_surrogate_in_trimmed_text(member: str, text: str) -> None:
    # The reader refuses a lone surrogate before any checker runs; built directly, only the
    # checkers stand between it and a request no UTF-8 body can carry.
    ProfileSetArgs(**{member: "Ada"})
    with pytest.raises(ValueError):
        ProfileSetArgs(**{member: text})


def test_a_request_is_built_only_with_the_integer_version_one() -> None:
    # True == 1 in Python: a built Request must hold the integer NIP-BA's actionVersion is.
    args = MessagePostArgs(channel_id=CHANNEL, content="x")
    Request(request_id=REQUEST_ID, action="message.post", action_version=1, args=args)
    for version in (True, 1.0):
        with pytest.raises(ValueError):
            Request(request_id=REQUEST_ID, action="message.post",
                    action_version=version, args=args)  # type: ignore[arg-type]


def test_build_request_versions_and_request_id() -> None:
    with pytest.raises(ContractError) as err:
        build_request("message.post", VALID_ARGS["message.post"], request_id="has space")
    assert err.value.pointer == "/requestId"
    with pytest.raises(ContractError) as err:
        build_request("message.post", VALID_ARGS["message.post"], request_id="r", action_version=2)
    assert err.value.code is ErrorCode.UNSUPPORTED_ACTION_VERSION


def test_encode_request_omits_absent_members() -> None:
    request = build_request("channel.read", {"channelId": CHANNEL.upper(), "mentionsOnly": False},
                            request_id="r1")
    assert encode_request(request) == (
        b'{"type":"broker_request","protocolVersion":1,"requestId":"r1","actionVersion":1,'
        b'"action":"channel.read","args":{"channelId":"' + CHANNEL.encode() + b'"}}'
    )
