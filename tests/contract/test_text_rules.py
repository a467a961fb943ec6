"""The contract's text rules, table-driven: NIP-BA's channel spellings, trimming by exactly
Unicode White_Space, the characters a name may not hold (a host rule), and the one escape
for agent text shown to an operator. Each table runs through the daemon's reader
(`read_request`) and through the agent-side client's `freeze`, which share the contract,
so both sides accept exactly the same set.

Tests assert codes, pointers and values, never message text."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from buzz_broker_client import AsyncBrokerClient
from buzzwire.contract import (
    WHITE_SPACE, ContractError, ErrorCode, normalize_channel_id, normalize_hex64, printable,
    printable_json, printable_json_text, read_request, trim,
)
from tests.contract.vectors import CHANNEL, EVENT_ID, PK1, REQUEST_ID, VALID_ARGS, body, envelope

I = ErrorCode.INVALID_REQUEST
HEX = CHANNEL.replace("-", "")
UP = CHANNEL.upper()


def _client() -> AsyncBrokerClient:
    # Constructing connects nowhere; `freeze` is the client's validate-and-normalize step.
    return AsyncBrokerClient("/nonexistent/broker.sock", "bb1.text-rules-0b5d4e8a9c713f2b6d8e")


def host_reads(action: str, args: dict[str, Any]) -> Any:
    """The validated args, or the pointer of the invalid_request fault, as the daemon reads."""
    reading = read_request(body(envelope(action, args)))
    assert reading.request_id == REQUEST_ID
    if reading.error is not None:
        assert reading.error.code is I
        return reading.error.pointer
    assert reading.request is not None
    return reading.request.args


def client_freezes(action: str, args: dict[str, Any]) -> Any:
    """The same, as the agent-side client freezes a request before sending it."""
    try:
        return _client().freeze(action, args, REQUEST_ID).args
    except ContractError as exc:
        assert exc.code is I
        return exc.pointer


def both(action: str, args: dict[str, Any]) -> Any:
    host, client = host_reads(action, args), client_freezes(action, args)
    assert host == client, "the daemon and the agent-side client must agree"
    return host


# --- channel spellings: exactly NIP-BA's ("Wire and normalization") ------------------------

#: (spelling, accepted). Accepted: hyphenated in any letter case, 32 hex, braces around the
#: hyphenated form, lowercase `urn:uuid:` + hyphenated; surrounding White_Space trimmed.
CHANNEL_SPELLINGS: list[tuple[str, bool]] = [
    (CHANNEL, True),
    (UP, True),
    ("5DF7dfa8-E919-43df-8EFD-f1dcb8af7071", True),
    (HEX, True),
    (HEX.upper(), True),
    ("{" + CHANNEL + "}", True),
    ("{" + UP + "}", True),
    ("urn:uuid:" + CHANNEL, True),
    ("urn:uuid:" + UP, True),
    ("\u3000" + CHANNEL + "\u2029", True),
    ("{" + HEX + "}", False),             # braces go around the hyphenated form only
    ("urn:uuid:" + HEX, False),           # the URN prefix likewise
    ("URN:UUID:" + CHANNEL, False),       # the prefix is lowercase
    ("Urn:Uuid:" + CHANNEL, False),
    ("{urn:uuid:" + CHANNEL + "}", False),
    ("urn:uuid:{" + CHANNEL + "}", False),
    ("{{" + CHANNEL + "}}", False),
    (CHANNEL.replace("-", "", 1), False),  # hyphens in all four places or none
    (CHANNEL + "\x1c", False),            # U+001C is not White_Space: not trimmed
    ("\x1f" + CHANNEL, False),
]


@pytest.mark.parametrize(("spelling", "accepted"), CHANNEL_SPELLINGS)
def test_channel_spellings(spelling: str, accepted: bool) -> None:
    assert normalize_channel_id(spelling) == (CHANNEL if accepted else None)
    answer = both("channel.read", {"channelId": spelling})
    if accepted:
        assert answer.channel_id == CHANNEL
    else:
        assert answer == "/args/channelId"


# --- trimming: the 25 White_Space code points, nothing else -------------------------------

#: Unicode PropList.txt, White_Space, written out by code point (not derived from Python).
PROPLIST_WHITE_SPACE = [
    0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B),
    0x2028, 0x2029, 0x202F, 0x205F, 0x3000,
]
#: What str.strip() also removes and White_Space does not hold.
SEPARATORS = ["\x1c", "\x1d", "\x1e", "\x1f"]


def test_white_space_is_the_unicode_property() -> None:
    assert len(PROPLIST_WHITE_SPACE) == 25
    assert sorted(map(ord, WHITE_SPACE)) == PROPLIST_WHITE_SPACE
    for sep in SEPARATORS:
        assert sep.strip() == "" and trim(sep) == sep


@pytest.mark.parametrize("space", [chr(c) for c in PROPLIST_WHITE_SPACE])
def test_every_white_space_is_trimmed_from_every_kind_of_scalar(space: str) -> None:
    pad = lambda s: space + s + space  # noqa: E731
    assert normalize_hex64(pad(EVENT_ID.upper())) == EVENT_ID
    assert normalize_channel_id(pad(CHANNEL)) == CHANNEL
    assert both("storage.address", {"slug": pad("core")}).slug == "core"
    created = both("agents.create", {**VALID_ARGS["agents.create"], "displayName": pad("Bob"),
                                     "respondTo": pad("anyone"), "model": pad("m")})
    assert (created.display_name, created.respond_to, created.model) == ("Bob", "anyone", "m")
    # content is never trimmed, and White_Space alone is blank.
    posted = both("message.post", {"channelId": CHANNEL, "content": pad("x")})
    assert posted.content == pad("x")
    assert both("message.post", {"channelId": CHANNEL, "content": pad("")}) == "/args/content"


#: (action, args, pointer) for each scalar whose trailing U+001C-U+001F is now kept, and
#: therefore refused: by its grammar (ids, slugs, modes) or by the host's name rule.
KEPT_AND_REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("channel.read", {"channelId": CHANNEL, "rootEventId": EVENT_ID + "{}"}, "/args/rootEventId"),
    ("message.post", {"channelId": CHANNEL, "content": "x", "mentions": [PK1 + "{}"]},
     "/args/mentions/0"),
    ("storage.address", {"slug": "core{}"}, "/args/slug"),
    ("agents.delete", {"target": {"pubkey": PK1 + "{}"}}, "/args/target/pubkey"),
    ("agents.create", {**VALID_ARGS["agents.create"], "respondTo": "anyone{}"}, "/args/respondTo"),
    ("profile.set", {"displayName": "{}Bob"}, "/args/displayName"),
    ("agents.create", {**VALID_ARGS["agents.create"], "displayName": "{}Bob"}, "/args/displayName"),
    ("agents.delete", {"target": {"name": "Bob{}"}}, "/args/target/name"),
]


@pytest.mark.parametrize("sep", SEPARATORS)
@pytest.mark.parametrize(("action", "args", "pointer"), KEPT_AND_REFUSED)
def test_information_separators_are_not_trimmed(sep: str, action: str, args: dict[str, Any],
                                                pointer: str) -> None:
    filled = json.loads(json.dumps(args).replace("{}", json.dumps(sep)[1:-1]))
    assert both(action, filled) == pointer


@pytest.mark.parametrize("sep", SEPARATORS)
def test_content_of_separators_is_not_blank(sep: str) -> None:
    # NIP-BA: content must hold a non-White_Space character and keeps every byte.
    for content in (sep, sep * 3, " " + sep + "\n"):
        assert both("message.post", {"channelId": CHANNEL, "content": content}).content == content
    reply = {"channelId": CHANNEL, "replyToEventId": EVENT_ID, "content": sep}
    assert both("message.reply", reply).content == sep


# --- characters a name may not hold (host rule, docs/protocol.md) -------------------------

OSC_TITLE = "\x1b]0;owned\x07\x1b[2K\rBob"
#: One-line scalars refuse each of these anywhere inside (after trimming).
LINE_REFUSED = ["\x00", "\x07", "\x08", "\x1b", "\t", "\n", "\r", "\x7f", "\x85", "\x9b", "\x9d",
                "\u2028", "\u2029", "\u202a", "\u202b", "\u202c", "\u202d", "\u202e", "\u2066",
                "\u2067", "\u2068", "\u2069"]
#: Prose keeps its line structure and bidi embeddings, and refuses the other controls.
PROSE_KEPT = ["\t", "\n", "\r", "\r\n", "\u2028", "\u202b", "\u2067"]
PROSE_REFUSED = ["\x00", "\x07", "\x1b", "\x0b", "\x0c", "\x1c", "\x7f", "\x85", "\x9b"]
#: Format characters names keep: ZWJ (emoji sequences), ZWNJ (Persian), LRM, soft hyphen.
LINE_KEPT = ["\u200d", "\u200c", "\u200e", "\u00ad", "\ufeff", "é", "👍"]

#: (action, the args around the member, the member's pointer) for each one-line scalar.
LINE_FIELDS: list[tuple[str, dict[str, Any], str]] = [
    ("agents.create", VALID_ARGS["agents.create"], "/args/displayName"),
    ("agents.create", VALID_ARGS["agents.create"], "/args/runtime"),
    ("agents.create", VALID_ARGS["agents.create"], "/args/provider"),
    ("agents.create", VALID_ARGS["agents.create"], "/args/model"),
    ("agents.update", VALID_ARGS["agents.update"], "/args/displayName"),
    ("agents.update", VALID_ARGS["agents.update"], "/args/model"),
    ("agents.update", {"target": {"name": "x"}, "model": "m"}, "/args/target/name"),
    ("profile.set", VALID_ARGS["profile.set"], "/args/displayName"),
    ("profile.set", VALID_ARGS["profile.set"], "/args/picture"),
    ("reaction.add", VALID_ARGS["reaction.add"], "/args/reaction"),
]
PROSE_FIELDS: list[tuple[str, dict[str, Any], str]] = [
    ("agents.create", VALID_ARGS["agents.create"], "/args/systemPrompt"),
    ("agents.update", VALID_ARGS["agents.update"], "/args/systemPrompt"),
    ("profile.set", VALID_ARGS["profile.set"], "/args/about"),
]


def _with(args: dict[str, Any], pointer: str, value: str) -> dict[str, Any]:
    out = json.loads(json.dumps(args))
    *path, last = pointer.split("/")[2:]
    place = out
    for key in path:
        place = place[key]
    place[last] = value
    return out


def _member(args: Any, pointer: str) -> Any:
    value = args
    for key in pointer.split("/")[2:]:
        value = getattr(value, re.sub(r"([A-Z])", lambda m: "_" + m.group().lower(), key))
    return value


def test_the_issue_name_is_refused() -> None:
    create = {**VALID_ARGS["agents.create"], "displayName": OSC_TITLE}
    assert both("agents.create", create) == "/args/displayName"


@pytest.mark.parametrize(("action", "args", "pointer"), LINE_FIELDS)
def test_one_line_scalars_refuse_controls_and_bidi(action: str, args: dict[str, Any],
                                                   pointer: str) -> None:
    for char in LINE_REFUSED:
        assert both(action, _with(args, pointer, f"a{char}b")) == pointer, repr(char)
    for char in LINE_KEPT:
        assert _member(both(action, _with(args, pointer, f"a{char}b")), pointer) == f"a{char}b"


@pytest.mark.parametrize(("action", "args", "pointer"), PROSE_FIELDS)
def test_prose_keeps_lines_and_refuses_other_controls(action: str, args: dict[str, Any],
                                                      pointer: str) -> None:
    for kept in PROSE_KEPT:
        assert _member(both(action, _with(args, pointer, f"a{kept}b")), pointer) == f"a{kept}b"
    for char in PROSE_REFUSED:
        assert both(action, _with(args, pointer, f"a{char}b")) == pointer, repr(char)


def test_content_is_refused_no_character() -> None:
    # Published exactly as written (NIP-BA); shown to an operator only through `printable`.
    content = OSC_TITLE + "".join(LINE_REFUSED)
    assert both("message.post", {"channelId": CHANNEL, "content": content}).content == content


# --- the one escape for showing agent text -------------------------------------------------

#: Every character a terminal could act on.
_RAW = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
HOSTILE = [OSC_TITLE, "\x9b2J\x9d52;c;AAAA\x9c", "abc\u202edcba", "\ud800lone", "tab\there\n",
           "plain é 👍 \u200d", "back\\x1bslash"]


@pytest.mark.parametrize("text", HOSTILE)
def test_printable_leaves_no_raw_control(text: str) -> None:
    shown = printable(text)
    assert _RAW.search(shown) is None
    shown.encode("utf-8")  # a lone surrogate would have made printing raise
    if _RAW.search(text) is None and "\\" not in text:
        assert shown == text  # ordinary text is shown as it is


def test_printable_cannot_be_forged() -> None:
    # A name that spells an escape is shown with its backslash doubled, not as ESC.
    assert printable("\x1b") == "\\x1b"
    assert printable("\\x1b") == "\\\\x1b"
    assert printable("\u202e") == "\\u202e"


@pytest.mark.parametrize("text", HOSTILE)
def test_printable_json_is_the_same_value(text: str) -> None:
    shown = printable_json({"name": text, "n": 1})
    assert _RAW.search(shown) is None
    assert json.loads(shown) == {"name": text, "n": 1}
    assert json.loads(printable_json([text], compact=True)) == [text]


@pytest.mark.parametrize("text", HOSTILE)
def test_printable_json_text_of_pretty_printed_json_is_one_line_of_the_same_value(
        text: str) -> None:
    # A host may put TAB, LF and CR between tokens (valid JSON); outside a string they
    # cannot be written as \u000a, so they go, and the output stays one line of JSON.
    value = {"type": "broker_result", "error": {"message": text, "codes": [1, 2.5, None]}}
    pretty = json.dumps(value, indent="\t", ensure_ascii=False).replace("\n", "\r\n")
    shown = printable_json_text(pretty)
    assert _RAW.search(shown) is None
    assert json.loads(shown) == value
