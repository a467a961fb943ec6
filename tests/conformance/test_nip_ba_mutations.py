"""NIP-BA's request-side mutations, applied to every vector and sent to the real daemon.

Rules:
- Each of the fifteen vectors of the shared NIP-BA vectors file (loaded as
  test_nip_ba_vectors.py loads them) is bound to a channel of this run's credential (one
  holding every action), so that the mutation is the only thing wrong with a request.
- The mutations are written from NIP-BA "Wire and normalization" and "Request": an unknown
  member (top level, in `args`, in a nested object), a duplicate member name (raw bytes),
  an explicit `null` at every depth, a wrong type for every member, integers as `1.0`,
  `-1`, one past their u16/u32 width and as a boolean, an empty `mentions` or `frames`, a
  blank scalar, every documented bound exceeded by one, each required member missing, a
  missing version, a wrong `type`, a version or action this host does not speak.
- Each must answer as NIP-BA says: a correlated `failed` with the table's code (checked on
  arrival by `_wire.Wire.send`: HTTP 200, the exact envelope, the requestId echoed, NIP-BA's
  result rules), or, when the requestId itself is unusable, no correlated verdict (a non-200
  status with an empty body: this host's answer). `liveness.ping` is not offered here, but
  its arguments are still checked first (docs/protocol.md), so it is held to the same codes.
- Every `invalid_request` must explain itself (issue 25 item 3): its message is
  `<pointer>: <reason>`, the reason one of the contract's `Rule` templates, exactly what the
  contract's reader says of the same bytes, and no string the request holds appears in it
  unless the rule's own words hold it (`_unexplained`).
- One daemon for the module: every mutation goes through one test, and the mismatches are
  collected and reported together (by name, never a body: a body holds the credential's
  requests only, but the list stays short). Afterwards the relay holds no event by the agent.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from buzzwire.contract import Rule, read_request
from tests.conformance import _spec
from tests.conformance._wire import Wire, fetch, known_agent
from tests.contract.vectors import reason_pattern
from tests.conformance.test_nip_ba_vectors import _VECTOR_CHANNEL, _bind, _vectors
from tests.fixtures.broker import BrokerHarness

INVALID = "invalid_request"
#: NIP-BA: version fields are u16, counts/kinds u32.
U16_PAST = 2**16
U32_PAST = 2**32
#: The vectors' pubkey (the secp256k1 generator's x): a valid point.
G = "79be667ef9dcbbac55a06295ce870b07029bfcdb2dce28d959f2815b16f81798"
#: Members NIP-BA makes optional in a vector's args: dropping them leaves a valid request.
OPTIONAL = {("channel.read", "limit"), ("message.post", "mentions")}


#: `<where>: <reason>`, where is a pointer or "(document)" (issue 25: docs/protocol.md §5).
_MESSAGE = re.compile(r"(\(document\)|(?:/(?:<member [1-9][0-9]*>|[^/ <]*))+): (.+)", re.S)
#: The member names NIP-BA defines in a request ("Request", "Actions"; Target's and a
#: frame's): the only names a pointer may spell; any other is shown by position.
_NAMES = set(_spec.REQUEST_MEMBERS) | {"pubkey", "name", "kind", "payload"} | {
    name for required, optional in _spec.NIP_BA_ARGS.values() for name in required | optional}
_SEGMENT = re.compile(r"<member [1-9][0-9]*>|[0-9]+")
#: Each rule's template as a pattern: placeholders stand for host digits and words.
_REASONS = [(rule, reason_pattern(rule)) for rule in Rule]


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for child in value.values():
            yield from _strings(child)
    elif isinstance(value, list):
        for child in value:
            yield from _strings(child)


def _unexplained(body: bytes, message: str) -> str | None:
    """Why an invalid_request message does not explain itself as issue 25 asks, or None."""
    form = _MESSAGE.fullmatch(message)
    if form is None:
        return "message is not <pointer>: <reason>"
    where, reason = form.groups()
    if where != "(document)" and not all(
            segment in _NAMES or _SEGMENT.fullmatch(segment) for segment in where.split("/")[1:]):
        return "pointer spells a member name NIP-BA does not define"
    rules = [rule for rule, pattern in _REASONS if pattern.fullmatch(reason)]
    if not rules:
        return "reason is no rule of the contract's table"
    error = read_request(body).error
    if error is None or error.message != message:
        return "message is not the contract's for these bytes"
    try:
        sent = json.loads(body)
    except ValueError:
        return None  # unreadable bytes are never correlated
    for text in _strings(sent):
        if len(text) >= 4 and text in reason and not any(text in r.value for r in rules):
            return "message quotes a value of the request"
    return None


@dataclass(frozen=True)
class Mutation:
    name: str
    body: bytes
    #: the codes NIP-BA allows; empty = no correlated verdict (requestId unusable)
    codes: frozenset[str]


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _envelope(request: dict[str, Any], **top: Any) -> dict[str, Any]:
    env = dict(request)
    env["requestId"] = str(uuid.uuid4())
    env.update(top)
    return env


def _wrong(value: Any) -> Any:
    """A value of another JSON type (booleans are not integers, nor strings)."""
    if isinstance(value, bool):
        return 1
    if isinstance(value, int):
        return "1"
    if isinstance(value, str):
        return 7
    if isinstance(value, list):
        return "x"
    return "x"


def _paths(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every member and element below `value`, with its path."""
    if isinstance(value, dict):
        for key, child in value.items():
            yield (*path, key), child
            yield from _paths(child, (*path, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield (*path, index), child
            yield from _paths(child, (*path, index))


def _set(args: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    copy = json.loads(_compact(args))
    node = copy
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = value
    return copy  # type: ignore[no-any-return]


def _memory_value_past(slug: str) -> str:
    """A value whose compact `{"slug":s,"value":v}` is 65,536 bytes: one over NIP-BA's cap."""
    overhead = len(_compact({"slug": slug, "value": ""}).encode("utf-8"))
    return "x" * (65_536 - overhead)


def _frames_past() -> list[dict[str, str]]:
    """One frame whose payload fits but whose compact `{"frames":[...]}` is 65,536 bytes."""
    overhead = len(_compact({"frames": [{"kind": "acp_write", "payload": ""}]}).encode("utf-8"))
    return [{"kind": "acp_write", "payload": "x" * (65_536 - overhead)}]


#: A slug of valid grammar one byte past 255 (segments of 64, then 57).
_SLUG_256 = "mem/" + "/".join(["a" * 64] * 3) + "/" + "a" * 57
assert len(_SLUG_256) == 256

#: Per action: (mutation name, the args it replaces the vector's with, the codes allowed),
#: NIP-BA's documented bounds each exceeded by one, and its enums and grammars broken.
BOUNDS: dict[str, list[tuple[str, Callable[[dict[str, Any]], dict[str, Any]]]]] = {
    "channel.read": [
        ("limit 0", lambda a: {**a, "limit": 0}),
        ("limit 501", lambda a: {**a, "limit": 501}),
        ("cursor 257 bytes", lambda a: {**a, "cursor": "!" * 257}),
        ("cursor with a space", lambda a: {**a, "cursor": "a b"}),
        ("rootEventId 65 hex", lambda a: {**a, "rootEventId": "a" * 65}),
        ("mentionsOnly as 1", lambda a: {**a, "mentionsOnly": 1}),
        ("channelId 37 chars", lambda a: {**a, "channelId": a["channelId"] + "0"}),
    ],
    "message.post": [
        ("content 65,537 bytes", lambda a: {**a, "content": "x" * 65_537}),
        ("content 65,537 bytes of 2-byte chars", lambda a: {**a, "content": "é" * 32_768 + "x"}),
        ("51 mentions", lambda a: {**a, "mentions": [G] * 51}),
        ("mention 65 hex", lambda a: {**a, "mentions": [G + "0"]}),
        ("mention not a point", lambda a: {**a, "mentions": ["0" * 64]}),
        ("content blank", lambda a: {**a, "content": " \u3000\n"}),
    ],
    "message.reply": [
        ("content 65,537 bytes", lambda a: {**a, "content": "x" * 65_537}),
        ("replyToEventId 65 hex", lambda a: {**a, "replyToEventId": "a" * 65}),
        ("empty mentions", lambda a: {**a, "mentions": []}),
        ("51 mentions", lambda a: {**a, "mentions": [G] * 51}),
    ],
    "reaction.add": [
        ("reaction 67 chars", lambda a: {**a, "reaction": "+" * 67}),
        ("targetEventId 63 hex", lambda a: {**a, "targetEventId": "a" * 63}),
    ],
    "profile.set": [
        ("displayName 121 chars", lambda a: {"displayName": "n" * 121}),
        ("about 2,001 chars", lambda a: {"about": "b" * 2001}),
        ("picture 301 chars", lambda a: {"picture": "p" * 301}),
        ("no field", lambda a: {}),
    ],
    "storage.address": [
        ("slug 256 bytes", lambda a: {"slug": _SLUG_256}),
        ("slug segment 65", lambda a: {"slug": "mem/" + "a" * 65}),
        ("slug outside the grammar", lambda a: {"slug": "mem/A"}),
    ],
    "storage.get": [
        ("slug 256 bytes", lambda a: {"slug": _SLUG_256}),
        ("slug outside the grammar", lambda a: {"slug": "notes"}),
    ],
    "storage.put": [
        ("slug 256 bytes", lambda a: {**a, "slug": _SLUG_256}),
        ("body 65,536 bytes", lambda a: {**a, "value": _memory_value_past(a["slug"])}),
        ("value blank", lambda a: {**a, "value": "  "}),
    ],
    "presence.set": [
        ("status outside the enum", lambda a: {"status": "busy"}),
        ("status in another case", lambda a: {"status": "Online"}),
    ],
    "typing.set": [
        ("channelId not a UUID", lambda a: {"channelId": "general"}),
    ],
    "observer.emit": [
        ("257 frames", lambda a: {"frames": a["frames"] * 257}),
        ("frame kind 301 chars", lambda a: {"frames": [{**a["frames"][0], "kind": "k" * 301}]}),
        ("payload 65,536 bytes", lambda a: {"frames": [{**a["frames"][0], "payload": "x" * 65_536}]}),
        ("frames 65,536 bytes", lambda a: {"frames": _frames_past()}),
        ("payload blank", lambda a: {"frames": [{**a["frames"][0], "payload": " "}]}),
    ],
    "liveness.ping": [
        ("turnId 301 chars", lambda a: {**a, "turnId": "t" * 301}),
    ],
    "agents.create": [
        ("displayName 121 chars", lambda a: {**a, "displayName": "n" * 121}),
        ("systemPrompt 20,001 chars", lambda a: {**a, "systemPrompt": "s" * 20_001}),
        ("runtime 301 chars", lambda a: {**a, "runtime": "r" * 301}),
        ("provider 301 chars", lambda a: {**a, "provider": "p" * 301}),
        ("model 301 chars", lambda a: {**a, "model": "m" * 301}),
        ("respondTo outside the enum", lambda a: {**a, "respondTo": "nobody"}),
    ],
    "agents.update": [
        ("target name 121 chars", lambda a: {**a, "target": {"name": "n" * 121}}),
        ("displayName 121 chars", lambda a: {**a, "displayName": "n" * 121}),
        ("systemPrompt 20,001 chars", lambda a: {**a, "systemPrompt": "s" * 20_001}),
        ("model 301 chars", lambda a: {**a, "model": "m" * 301}),
        ("no mutable field", lambda a: {"target": a["target"]}),
        ("target with both selectors", lambda a: {**a, "target": {"pubkey": G, "name": "x"}}),
        ("target empty", lambda a: {**a, "target": {}}),
    ],
    "agents.delete": [
        ("target name 121 chars", lambda a: {"target": {"name": "n" * 121}}),
        ("target name blank", lambda a: {"target": {"name": "  "}}),
        ("target with both selectors", lambda a: {"target": {"pubkey": G, "name": "x"}}),
    ],
}


def _mutations(request: dict[str, Any]) -> Iterator[Mutation]:
    action: str = request["action"]
    args: dict[str, Any] = request["args"]
    bad = frozenset({INVALID})

    def correlated(name: str, env: dict[str, Any], codes: frozenset[str] = bad) -> Mutation:
        return Mutation(f"{action}: {name}", _compact(env).encode("utf-8"), codes)

    def fresh() -> str:
        """The vector's request under a new requestId, compact (bytes to edit)."""
        return _compact(_envelope(request))

    def with_args(name: str, new: dict[str, Any]) -> Mutation:
        return correlated(name, _envelope(request, args=new))

    # Unknown members: top level, args, and each nested object.
    yield correlated("unknown top-level member", _envelope(request, requester=G))
    yield with_args("unknown member in args", {**args, "extra": "x"})
    for path, child in _paths(args):
        if isinstance(child, dict):
            yield with_args(f"unknown member in {path}", _set(args, path, {**child, "extra": "x"}))
    # Explicit null and a wrong type, at every depth of args.
    for path, child in _paths(args):
        yield with_args(f"null at {path}", _set(args, path, None))
        yield with_args(f"wrong type at {path}", _set(args, path, _wrong(child)))
        if isinstance(child, str):
            yield with_args(f"blank at {path}", _set(args, path, " \t"))
    # Null, a wrong type, or absence of each top-level member other than requestId.
    for member in ("type", "protocolVersion", "actionVersion", "action", "args"):
        yield correlated(f"{member} null", _envelope(request, **{member: None}))
        yield correlated(f"{member} wrong type",
                         _envelope(request, **{member: _wrong(request[member])}))
        env = _envelope(request)
        env.pop(member)
        yield correlated(f"{member} missing", env)
    yield correlated("args an array", _envelope(request, args=[args]))
    yield correlated("type broker_result", _envelope(request, type="broker_result"))
    yield correlated("type in another case", _envelope(request, type="Broker_Request"))
    # Integers: integer syntax, nonnegative, within the width; booleans are not integers.
    for member, past in (("protocolVersion", U16_PAST), ("actionVersion", U16_PAST)):
        for spelling in ("1.0", "1e0"):
            yield Mutation(f"{action}: {member} {spelling}", fresh().replace(
                f'"{member}":1', f'"{member}":{spelling}', 1).encode(), bad)
        yield correlated(f"{member} -1", _envelope(request, **{member: -1}))
        yield correlated(f"{member} past u16", _envelope(request, **{member: past}))
        yield correlated(f"{member} true", _envelope(request, **{member: True}))
    yield correlated("protocolVersion 2", _envelope(request, protocolVersion=2),
                     frozenset({"unsupported_protocol_version"}))
    yield correlated("actionVersion 2", _envelope(request, actionVersion=2),
                     frozenset({"unsupported_action_version"}))
    yield correlated("protocolVersion 0", _envelope(request, protocolVersion=0),
                     frozenset({"unsupported_protocol_version", INVALID}))
    yield correlated("unknown action", _envelope(request, action=action + "x"),
                     frozenset({"unknown_action"}))
    yield correlated("action in another case", _envelope(request, action=action.upper()),
                     frozenset({"unknown_action"}))
    for path, child in _paths(args):
        if isinstance(child, int) and not isinstance(child, bool):
            key = f'"{path[-1]}":{child}'
            yield Mutation(f"{action}: {path} as {child}.0",
                           fresh().replace(key, f"{key}.0").encode(), bad)
            yield with_args(f"{path} -1", _set(args, path, -1))
            yield with_args(f"{path} past u32", _set(args, path, U32_PAST))
            yield with_args(f"{path} true", _set(args, path, True))
    # Each required member missing, at every depth (an element of a required array too).
    for key in args:
        if (action, key) not in OPTIONAL:
            yield with_args(f"{key} missing", {k: v for k, v in args.items() if k != key})
    for path, child in _paths(args):
        if isinstance(child, dict):
            for key in child:
                yield with_args(f"{key} missing at {path}",
                                _set(args, path, {k: v for k, v in child.items() if k != key}))
    # Empty arrays NIP-BA forbids.
    if "mentions" in args:
        yield with_args("empty mentions", {**args, "mentions": []})
    if "frames" in args:
        yield with_args("empty frames", {"frames": []})
    # Documented bounds, enums and grammars.
    for name, make in BOUNDS[action]:
        yield with_args(name, make(args))
    # Duplicate member names, as raw bytes: top level, args, nested.
    yield Mutation(f"{action}: duplicate type", fresh().replace(
        '{"type":', '{"type":"broker_request","type":', 1).encode(), bad)
    first = next(iter(args))
    dup = f'"args":{{{_compact(first)}:{_compact(args[first])},'
    yield Mutation(f"{action}: duplicate {first} in args",
                   fresh().replace('"args":{', dup, 1).encode(), bad)
    for path, child in _paths(args):
        if isinstance(child, dict):
            inner = next(iter(child))
            marker = f"{{{_compact(inner)}:"
            pair = f"{_compact(inner)}:{_compact(child[inner])},"
            body = fresh()
            at = body.index(marker, body.index('"args":'))
            yield Mutation(f"{action}: duplicate {inner} at {path}",
                           (body[:at + 1] + pair + body[at + 1:]).encode(), bad)
    # No usable requestId: no correlated verdict (NIP-BA: the host must not execute it).
    env = _envelope(request)
    env.pop("requestId")
    yield Mutation(f"{action}: requestId missing", _compact(env).encode(), frozenset())
    for value in (None, 7, "", "x" * 129, "has space", "é"):
        yield Mutation(f"{action}: requestId {value!r:.12}",
                       _compact(_envelope(request, requestId=value)).encode(), frozenset())
    yield Mutation(f"{action}: duplicate requestId",
                   fresh().replace('{"type":', '{"requestId":"a","type":', 1).encode(), frozenset())


async def test_every_nip_ba_mutation_of_every_vector(broker: BrokerHarness) -> None:
    channel = str(uuid.uuid4())
    who = await known_agent(broker, "mutations", [channel])
    wire = Wire(broker)
    wire.bind(who.credential, who.pubkey)
    requests = [_bind(v["request"], {_VECTOR_CHANNEL: channel}) for v in _vectors()]
    assert len({r["action"] for r in requests}) == 15
    wrong: list[str] = []
    count = 0
    for request in requests:
        for mutation in _mutations(request):
            count += 1
            if not mutation.codes:
                reply = await wire.send_uncorrelated(mutation.body, who.credential)
                if reply.status == 200 or reply.body != b"":
                    wrong.append(f"{mutation.name}: HTTP {reply.status}, a body")
                continue
            env = await wire.send(mutation.body, who.credential)  # checked on arrival
            code = env.get("error", {}).get("code") if env["status"] == "failed" else None
            if code not in mutation.codes:
                wrong.append(f"{mutation.name}: {env['status']} {code}")
            elif code == INVALID:
                problem = _unexplained(mutation.body, env["error"]["message"])
                if problem is not None:
                    wrong.append(f"{mutation.name}: {problem}")
    assert not wrong, "\n".join([f"{len(wrong)} of {count}", *wrong])
    assert count > 600, count  # every mutation family ran for every action
    # Nothing any of them asked for happened on the relay.
    assert await fetch(broker, {"authors": [who.pubkey]}) == []
