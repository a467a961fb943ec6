"""Generate docs/schema/{request,response}.schema.json from the wire contract's tables.

    python scripts/json_schemas.py          # rewrite the two files
    python scripts/json_schemas.py --check  # exit 1 if they are not what the contract says

What comes from `buzzwire.contract` itself: the nine actions (`ACTIONS`), every shape's
member names and which are required (`SHAPES`), the envelopes' members, the error codes
and which status each may travel with (`PAIRING`), every limit (`_limits`) and the slug
grammar. What this file adds is the one thing the contract keeps as code rather than data:
what each member's checker accepts, as JSON Schema (`VALUES`, by wire name, and
`OBJECT_RULES` for the cross-member rules). A member with no entry there is an error, so a
new member cannot ship without its schema; tests/docs/test_protocol_doc.py holds the files
to this script.

The request schema describes what a conforming client may send: the contract's readers
trim and accept several spellings, and so does it. The response schema describes exactly
what a host sends: every outcome value in the canonical form the contract's outcome classes
hold it in (`check_instance` refuses any other), so ids and pubkeys are 64 lowercase hex, a
channel is lowercase hyphenated, a name is already trimmed and holds nothing a name may
not (`OUTPUT_VALUES`), and each action's `kind` is the one it reports (`_reported_kind`).
The client's reader is looser than that (it forgives the spelling of an identity,
docs/protocol.md §7); the response schema is the host's promise, not the reader.

They are necessary, not sufficient: JSON Schema cannot say that a pubkey is a point on
secp256k1, that content is at most 65,536 UTF-8 *bytes*, or that a trimmed request field is
trimmed before it is measured (a member padded with spaces may pass the host and fail
`maxLength`). The host's checks are the contract's; docs/protocol.md says so too.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # buzzwire/ is at the top, its own distribution

from buzzwire import kinds  # noqa: E402
from buzzwire.contract import (  # noqa: E402
    ACTIONS, MAX_ABOUT_CHARS, MAX_CONTENT_BYTES, MAX_CURSOR_BYTES, MAX_DISPLAY_NAME_CHARS,
    MAX_JSON_INT, MAX_KIND, MAX_LIMIT, MAX_MENTIONS, MAX_PICTURE_CHARS, MAX_REACTION_CHARS,
    MAX_MEMORY_BODY_BYTES, MAX_REQUEST_ID_BYTES, MAX_SCALAR_CHARS, MAX_SLUG_BYTES,
    MAX_SYSTEM_PROMPT_CHARS, MIN_LIMIT, PAIRING, PROTOCOL_VERSION, ACTION_VERSION, RESPOND_TO,
    PRESENCE_STATUSES, AgentsUpdateArgs, AgentTarget, ErrorCode, Event, ProfileSetArgs, Status,
    StoragePutArgs, MAX_FRAMES, MAX_OBSERVER_BYTES, MAX_U32, ObserverEmitArgs, ObserverFrame,
    ActionSpec, StorageAddressOutcome,
)
from buzzwire.contract import REQUEST_MEMBERS, WHITE_SPACE  # noqa: E402
from buzzwire.contract._envelopes import _ERROR_MEMBERS, _SUCCEEDED_MEMBERS  # noqa: E402
from buzzwire.contract._ids import _SLUG  # noqa: E402
from buzzwire.contract._shapes import SHAPES, Shape  # noqa: E402
from buzzwire.contract._text import _REFUSED, TextKind, refused_in  # noqa: E402

OUT = REPO / "docs" / "schema"
DIALECT = "https://json-schema.org/draft/2020-12/schema"

_HEX = "[0-9a-fA-F]"
_UUID_HYPHENATED = f"{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}"
# NIP-BA's four channel spellings (contract/_ids.py).
_UUID = (f"(?:{_UUID_HYPHENATED}|{_HEX}{{32}}|\\{{{_UUID_HYPHENATED}\\}}"
         f"|urn:uuid:{_UUID_HYPHENATED})")


def _escaped(chars: str) -> str:
    """Characters of a class as \\uXXXX (a `-` between two is a range and stays)."""
    return "".join(c if c == "-" else f"\\u{ord(c):04x}" for c in chars)


# Unicode White_Space exactly (ECMA-262's \s differs: it holds U+FEFF, not U+0085).
_WHITE_SPACE = _escaped(WHITE_SPACE)
_WS = f"[{_WHITE_SPACE}]*"
_VISIBLE = "[\\x21-\\x7e]"


def _string(pattern: str | None = None, **more: object) -> dict[str, object]:
    out: dict[str, object] = {"type": "string"}
    if pattern is not None:
        out["pattern"] = pattern
    out.update(more)
    return out


def _text(max_chars: int) -> dict[str, object]:
    # Trimmed text: something besides whitespace, at most max_chars once trimmed.
    return _string("\\S", maxLength=max_chars)


def _name(max_chars: int) -> dict[str, object]:
    # A name as a host writes it (contract `text`, LINE): trimmed, not empty, nothing a
    # name may not hold. Without lookaround, which not every JSON Schema engine has (so
    # under Python's `$`, see _exact, one final "\n" still passes).
    refused = _escaped(_REFUSED[TextKind.LINE].pattern[1:-1])
    trimmed = _escaped("".join(c for c in WHITE_SPACE if not refused_in(c, TextKind.LINE)))
    inner, end = f"[^{refused}]", f"[^{refused}{trimmed}]"
    return _string(f"^{end}(?:{inner}*{end})?$", maxLength=max_chars)


def _exact(pattern: str, width: int) -> dict[str, object]:
    # A fixed-width value as a host writes it. maxLength as well: ECMA-262's `$` is the end
    # of input, but Python's re (the jsonschema package) also matches it before a final
    # "\n", so the pattern alone would let "<64 hex>\n" through there.
    return _string(f"^{pattern}$", maxLength=width)


def _integer(low: int, high: int = MAX_JSON_INT) -> dict[str, object]:
    return {"type": "integer", "minimum": low, "maximum": high}


CHANNEL_ID = _string(f"^{_WS}{_UUID}{_WS}$")
HEX64 = _string(f"^{_WS}{_HEX}{{64}}{_WS}$")
LOWER_HEX64 = _exact("[0-9a-f]{64}", 64)
CURSOR = _string(f"^{_VISIBLE}{{1,{MAX_CURSOR_BYTES}}}$")
NAME = _text(MAX_DISPLAY_NAME_CHARS)
SCALAR = _text(MAX_SCALAR_CHARS)
KIND = _integer(0, MAX_KIND)
TIMESTAMP = _integer(0)

#: wire name -> what its checker accepts. One entry per name: a name means one thing in
#: every shape that has it (the contract's shape tables reuse their fields that way).
VALUES: Mapping[str, dict[str, object]] = {
    "channelId": CHANNEL_ID,
    "rootEventId": HEX64,
    "replyToEventId": HEX64,
    "targetEventId": HEX64,
    "eventId": HEX64,
    "dTag": HEX64,
    "pubkey": HEX64,
    "authorPubkey": HEX64,
    "agentPubkey": HEX64,
    "mentionsOnly": {"type": "boolean"},
    "cursor": CURSOR,
    "nextCursor": CURSOR,
    "limit": _integer(MIN_LIMIT, MAX_LIMIT),
    # content: published as written, not whitespace-only; the bound is in UTF-8 bytes,
    # which a character count can only approximate from above.
    "content": _string("\\S", maxLength=MAX_CONTENT_BYTES),
    "mentions": {"type": "array", "items": HEX64, "minItems": 1, "maxItems": MAX_MENTIONS},
    "reaction": _text(MAX_REACTION_CHARS),
    "displayName": NAME,
    "name": NAME,
    "about": _text(MAX_ABOUT_CHARS),
    "picture": _text(MAX_PICTURE_CHARS),
    "systemPrompt": _text(MAX_SYSTEM_PROMPT_CHARS),
    "runtime": SCALAR,
    "provider": SCALAR,
    "model": SCALAR,
    "respondTo": {"type": "string", "enum": list(RESPOND_TO)},
    "status": {"type": "string", "enum": list(PRESENCE_STATUSES)},
    "slug": _string(f"^{_WS}(?:{_SLUG.pattern}){_WS}$", maxLength=MAX_SLUG_BYTES),
    "target": {"$ref": "#/$defs/AgentTarget"},
    "kind": KIND,
    "createdAt": TIMESTAMP,
    "messages": {"type": "array", "items": {"$ref": "#/$defs/Event"}, "maxItems": MAX_LIMIT},
    "updatedFields": {"type": "array", "items": {"type": "string"}},
    # storage.put's value and storage.get's: one name, so the looser of the two (a stored
    # value may be ""; the contract refuses a blank put). Bytes, approximated from above.
    "value": _string(maxLength=MAX_MEMORY_BODY_BYTES),
    # observer.emit / liveness.ping (NIP-BA "Live signals"): payload kept as sent, bounded
    # in UTF-8 bytes like content; the whole compact body's 65,535 bytes is the host's.
    "frames": {"type": "array", "items": {"$ref": "#/$defs/ObserverFrame"},
               "minItems": 1, "maxItems": MAX_FRAMES},
    "payload": _string("\\S", maxLength=MAX_OBSERVER_BYTES),
    "turnId": SCALAR,
    "accepted": _integer(0, MAX_U32),
}

#: The one name that means something else in one shape: an observer frame's `kind` is the
#: runtime's discriminator, a scalar string, not a Nostr kind (NIP-BA "Live signals").
SHAPE_VALUES: Mapping[type, Mapping[str, dict[str, object]]] = {
    ObserverFrame: {"kind": SCALAR},
}

#: Response side: wire name -> what a host writes, where that is narrower than what the
#: reader accepts (`VALUES`). An outcome holds each value as its checker returns it, so the
#: host never writes a spelling the reader would have to normalize.
OUTPUT_VALUES: Mapping[str, dict[str, object]] = {
    "eventId": LOWER_HEX64,
    "dTag": LOWER_HEX64,
    "authorPubkey": LOWER_HEX64,
    "agentPubkey": LOWER_HEX64,
    # The canonical spelling, whichever of NIP-BA's four the request used (agent-broker.md
    # §Identities: "H's canonical echo"; the client compares the echo parsed, §7).
    "channelId": _exact("[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", 36),
    "displayName": _name(MAX_DISPLAY_NAME_CHARS),
    # The wire names of the members the update supplied that changed (agents_update.py),
    # each once: never `target`, which names the agent rather than changing it.
    "updatedFields": {"type": "array", "uniqueItems": True, "items": {"enum": sorted(
        f.wire for f in SHAPES[AgentsUpdateArgs].fields if f.wire != "target")}},
    # At most the frames sent (NIP-BA; the client checks it), and a request sends at most
    # MAX_FRAMES.
    "accepted": _integer(0, MAX_FRAMES),
}

#: Outcomes whose `kind` is fixed by the outcome, not by a published event: NIP-BA's
#: storage.address "returns the agent's author pubkey, kind 30174" (the client's check and
#: custody's address name the same constant).
OUTCOME_KINDS: Mapping[type, int] = {StorageAddressOutcome: kinds.MEMORY}

#: The signed event is verbatim relay data: its own spellings (NIP-01), exact case.
EVENT_VALUES: Mapping[str, dict[str, object]] = {
    "id": LOWER_HEX64,
    "pubkey": LOWER_HEX64,
    "created_at": TIMESTAMP,
    "kind": KIND,
    "tags": {"type": "array", "items": {"type": "array", "items": {"type": "string"}}},
    # The host drops a read event whose content is past NIP-BA's post bound in UTF-8 bytes
    # (channel_read `_size_ok`: Buzz's SDK refuses the page), which characters approximate.
    "content": _string(maxLength=MAX_CONTENT_BYTES),
    "sig": _exact("[0-9a-f]{128}", 128),
}

#: The cross-member rules of the shapes that have one (`Shape.rule`), as JSON Schema.
OBJECT_RULES: Mapping[type, dict[str, object]] = {
    ProfileSetArgs: {"minProperties": 1},
    AgentsUpdateArgs: {"minProperties": 2},  # target and at least one more
    AgentTarget: {"minProperties": 1, "maxProperties": 1},  # exactly one of pubkey, name
    # The compact body's 65,535-byte bound counts escapes: no JSON Schema keyword says it.
    StoragePutArgs: {},
    # The compact-encoding bound (65,535 bytes for the whole {"frames":...}) has no JSON
    # Schema spelling; the host checks it.
    ObserverEmitArgs: {},
}


def _object(shape: Shape[object], values: Mapping[str, dict[str, object]]) -> dict[str, object]:
    values = EVENT_VALUES if shape.cls is Event else values
    if shape.rule is not None and shape.cls not in OBJECT_RULES:
        raise KeyError(f"{shape.cls.__name__} has a cross-member rule with no schema")
    out: dict[str, object] = {
        "type": "object",
        "properties": {f.wire: SHAPE_VALUES.get(shape.cls, {}).get(f.wire) or values[f.wire]
                       for f in shape.fields},
        "required": [f.wire for f in shape.fields if f.required],
        "additionalProperties": False,
    }
    out.update(OBJECT_RULES.get(shape.cls, {}))
    return out


def _document(title: str, variants: list[dict[str, object]], classes: list[type],
              values: Mapping[str, dict[str, object]]) -> dict[str, object]:
    """One schema file: any one of `variants`, with the shapes they refer to under $defs."""
    return {
        "$schema": DIALECT,
        "title": title,
        "oneOf": variants,
        "$defs": {cls.__name__: _object(SHAPES[cls], values) for cls in dict.fromkeys(classes)},
    }


def _reported_kind(spec: ActionSpec) -> int | None:
    """The one kind `spec`'s outcome reports, from the contract's tables; None if none."""
    kind = spec.published_kind if spec.published_kind is not None else OUTCOME_KINDS.get(
        spec.outcome_type)
    if kind is None and "kind" in spec.outcome_members.all:
        raise KeyError(f"{spec.name}'s outcome reports a kind no table names")
    return kind


def _outcome(spec: ActionSpec) -> dict[str, object]:
    out: dict[str, object] = {"$ref": f"#/$defs/{spec.outcome_type.__name__}"}
    kind = _reported_kind(spec)
    if kind is not None:  # beside the $ref: the shape's members, and this one value
        out["properties"] = {"kind": {"const": kind}}
    return out


def _patterns(node: object) -> list[str]:
    if isinstance(node, dict):
        own = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
        return own + [p for child in node.values() for p in _patterns(child)]
    if isinstance(node, list):
        return [p for child in node for p in _patterns(child)]
    return []


def _envelope(members: dict[str, object], order: tuple[str, ...] | frozenset[str],
              optional: tuple[str, ...] = ()) -> dict[str, object]:
    return {
        "type": "object",
        "properties": members,
        "required": [m for m in members if m in order and m not in optional],
        "additionalProperties": False,
    }


def request_schema() -> dict[str, object]:
    variants = []
    for name, spec in ACTIONS.items():
        members = {
            "type": {"const": "broker_request"},
            "protocolVersion": {"const": PROTOCOL_VERSION},
            "requestId": _string(f"^{_VISIBLE}{{1,{MAX_REQUEST_ID_BYTES}}}$"),
            "actionVersion": {"const": ACTION_VERSION},
            "action": {"const": name},
            "args": {"$ref": f"#/$defs/{spec.args_type.__name__}"},
        }
        assert tuple(members) == REQUEST_MEMBERS
        variants.append(_envelope(members, REQUEST_MEMBERS))
    return _document("broker_request (agent-broker.md §Request, §Operations; NIP-BA)", variants,
                     [spec.args_type for spec in ACTIONS.values()] + [AgentTarget, ObserverFrame],
                     VALUES)


def response_schema() -> dict[str, object]:
    common = {
        "type": {"const": "broker_result"},
        "protocolVersion": {"const": PROTOCOL_VERSION},
        "requestId": _string(f"^{_VISIBLE}{{1,{MAX_REQUEST_ID_BYTES}}}$"),
    }
    # replayed: only ever true; a host omits it otherwise (Buzz's client tolerates false,
    # a host never sends it).
    replayed = {"replayed": {"const": True}}
    variants = []
    for name, spec in ACTIONS.items():
        members = {**common, "status": {"const": Status.SUCCEEDED.value}, "action": {"const": name},
                   "outcome": _outcome(spec), **replayed}
        assert set(members) - {"replayed"} == _SUCCEEDED_MEMBERS
        variants.append(_envelope(members, _SUCCEEDED_MEMBERS))
    for status in (Status.FAILED, Status.INDETERMINATE):
        codes = [code.value for code in ErrorCode if status in PAIRING[code]]
        error = {"type": "object", "additionalProperties": False, "required": ["code", "message"],
                 "properties": {"code": {"enum": codes}, "message": {"type": "string"}}}
        members = {**common, "status": {"const": status.value}, "error": error, **replayed}
        assert set(members) - {"replayed"} == _ERROR_MEMBERS
        variants.append(_envelope(members, _ERROR_MEMBERS))
    document = _document("broker_result (agent-broker.md §Results and errors, §Operations; NIP-BA)",
                         variants, [spec.outcome_type for spec in ACTIONS.values()] + [Event],
                         {**VALUES, **OUTPUT_VALUES})
    # A host writes canonical values only: a trimming, mixed-case or untrimmed-text pattern
    # here means a new outcome member took its request-side schema (give it an
    # OUTPUT_VALUES row).
    loose = [p for p in _patterns(document) if _WS in p or _HEX in p or p == "\\S"]
    if loose:
        raise AssertionError(f"response patterns that accept a non-canonical value: {loose}")
    return document


def render() -> dict[str, str]:
    """File name -> its exact text."""
    return {
        name: json.dumps(schema, indent=2, ensure_ascii=False) + "\n"
        for name, schema in (("request.schema.json", request_schema()),
                             ("response.schema.json", response_schema()))
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    stale = []
    for name, text in render().items():
        path = OUT / name
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(name)
        else:
            OUT.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
    if stale:
        print("stale: " + ", ".join(stale) + " (run python scripts/json_schemas.py)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
