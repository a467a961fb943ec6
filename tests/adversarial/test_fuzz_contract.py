"""Fuzzing the contract: any bytes in -> a Reading whose fault is a code `failed` may carry.

Invariant (style.md #22): for ANY body, `read_request` returns (never raises) within a
bounded time; an uncorrelated reading carries a fault; a correlated one carries exactly
one of a request or a fault, and the fault's code is one PAIRING allows with `failed`.
And `encode_response` of any verdict the contract lets us build re-parses with
`parse_response` to the same verdict.

Inputs, from blind to pointed:
- random bytes; random JSON documents; random JSON as `args`;
- every valid envelope of the nine actions mutated at every path of every depth: the
  member deleted, duplicated, set to null, retyped, and every object extended with an
  unknown member (enumerated exhaustively, then chained at random by hypothesis);
- huge and negative numbers in every integer slot; strings up to 1 MiB; nesting 10,000
  deep; invalid UTF-8 spliced in anywhere; lone surrogate escapes in keys and values.

The exhaustive mutation table also pins what the mutation must produce where the spec is
unambiguous (null, a repeated key, an unknown member, a wrong type, a missing required
member: never a Request; a mutation away from requestId: still correlated).
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from buzzwire.contract import (
    ACTIONS,
    MAX_SHOWN_POINTER_CHARS,
    MESSAGES,
    PAIRING,
    ContractError,
    ErrorCode,
    Reading,
    Status,
    Verdict,
    encode_response,
    Rule,
    parse_response,
    printable,
    read_request,
)
from tests.adversarial import scaled, tally
from tests.contract.vectors import REQUEST_ID, VALID_OUTCOMES, Pairs, dump
from tests.contract.vectors import envelope as _shared_envelope

#: Seconds one read_request may take on the largest input here (1 MiB). Measured: a few ms;
#: generous so a loaded CI box never flakes, tight enough to catch a quadratic walk.
MAX_SECONDS_PER_INPUT = 2.0
#: The longest message a refusal can carry: the cut pointer, ": ", the longest reason
#: (with room for its host-filled numbers).
_MAX_MESSAGE = MAX_SHOWN_POINTER_CHARS + 2 + max(len(rule.value) for rule in Rule) + 40

EXAMPLES = scaled(150, 4000)
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

_counts: dict[str, int] = {}


def check_reading(body: bytes, family: str) -> Reading:
    """The invariant, on one input. Returns the reading for further, sharper checks."""
    _counts[family] = _counts.get(family, 0) + 1
    started = time.perf_counter()
    reading = read_request(body)  # must not raise: any exception fails the test as is
    elapsed = time.perf_counter() - started
    assert elapsed < MAX_SECONDS_PER_INPUT, f"read_request took {elapsed:.2f}s on {len(body)} bytes"
    assert isinstance(reading, Reading)
    if reading.request_id is None:
        assert reading.request is None and isinstance(reading.error, ContractError)
    else:
        assert isinstance(reading.request_id, str) and reading.request_id
        assert (reading.request is None) != (reading.error is None)
    if reading.error is not None:
        assert isinstance(reading.error.code, ErrorCode)
        assert Status.FAILED in PAIRING[reading.error.code], reading.error.code
        assert isinstance(reading.error.pointer, str)
        # A correlated fault becomes an envelope: it must encode and re-parse.
        if reading.request_id is not None:
            # The message the daemon answers (issue 25): where and which rule, bounded,
            # nothing a terminal acts on, whatever the input.
            message = reading.error.message
            assert printable(message) == message and len(message) <= _MAX_MESSAGE, message
            verdict = Verdict.failed(reading.error.code, message)
            back = parse_response(encode_response(reading.request_id, verdict))
            assert back.request_id == reading.request_id and back.code is reading.error.code
    return reading


@pytest.fixture(scope="module", autouse=True)
def _report_counts() -> Iterator[None]:
    yield
    tally("fuzz_contract", {"inputs": dict(sorted(_counts.items())),
                            "total": sum(_counts.values())})


# --------------------------------------------------------------------------- mutations

def envelope(action: str, args: Any = None) -> dict[str, Any]:
    """A private deep copy of the shared vector: the tests below edit it in place."""
    return copy.deepcopy(_shared_envelope(action, args))


Path = tuple[str | int, ...]

#: One replacement value per JSON type (and two number shapes the protocol forbids).
RETYPES: dict[str, Any] = {
    "bool": True, "int": 7, "str": "x", "array": [], "object": {},
}


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, str):
        return "str"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return "null"


def paths(value: Any, prefix: Path = ()) -> Iterator[Path]:
    """Every member and element path below `value`, at every depth (root excluded).

    An object already written with a repeated key (`Pairs`) is a leaf: it is doomed anyway.
    """
    if isinstance(value, Pairs):
        return
    if isinstance(value, dict):
        for key, child in value.items():
            yield (*prefix, key)
            yield from paths(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield (*prefix, index)
            yield from paths(child, (*prefix, index))


def objects(value: Any, prefix: Path = ()) -> Iterator[Path]:
    """Every object's path, the root's included (a `Pairs` object is a leaf)."""
    if isinstance(value, Pairs):
        return
    if isinstance(value, dict):
        yield prefix
        for key, child in value.items():
            yield from objects(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from objects(child, (*prefix, index))


def _get(doc: Any, path: Path) -> Any:
    for step in path:
        doc = doc[step]
    return doc


def mutate(doc: Any, kind: str, path: Path, arg: Any = None) -> Any:
    """A copy of `doc` with one mutation. Duplicates become `Pairs` (JSON can repeat keys)."""
    doc = copy.deepcopy(doc)
    if kind == "extend":
        _get(doc, path)["zzUnknownMember"] = 1
        return doc
    parent_path, last = path[:-1], path[-1]
    if kind == "duplicate" and isinstance(last, str):
        replacement = Pairs([*_get(doc, parent_path).items(), (last, _get(doc, path))])
        if not parent_path:
            return replacement
        _get(doc, parent_path[:-1])[parent_path[-1]] = replacement
        return doc
    parent = _get(doc, parent_path)
    if kind == "delete":
        del parent[last]
    elif kind == "duplicate":  # an array element repeated
        parent.insert(last, copy.deepcopy(parent[last]))
    elif kind == "null":
        parent[last] = None
    elif kind == "retype":
        parent[last] = arg
    else:  # pragma: no cover - the table below names only the kinds above
        raise AssertionError(kind)
    return doc


def all_mutations(action: str) -> Iterator[tuple[str, Path, Any]]:
    base = envelope(action)
    for path in paths(base):
        yield "delete", path, None
        yield "duplicate", path, None
        yield "null", path, None
        current = _json_type(_get(base, path))
        for name, value in RETYPES.items():
            if name != current:
                yield "retype", path, value
    for path in objects(base):
        yield "extend", path, None


def _required(action: str, path: Path) -> bool:
    """Is the member at `path` one the request cannot do without?"""
    if len(path) == 1:
        return True  # all six envelope members are required
    if len(path) == 2 and path[0] == "args":
        return path[1] in ACTIONS[action].arg_members.required
    if len(path) == 3 and path[:2] == ("args", "target"):
        return True  # exactly one of pubkey/name; the vectors use one
    return False


MUTATIONS = [(action, *m) for action in ACTIONS for m in all_mutations(action)]


def test_the_valid_vectors_are_requests() -> None:
    for action in ACTIONS:
        reading = check_reading(dump(envelope(action)).encode(), "valid")
        assert reading.request is not None and reading.request.action == action


def test_every_mutation_at_every_depth() -> None:
    """The exhaustive table: 9 actions x every path x delete/duplicate/null/retype/extend."""
    assert len(MUTATIONS) > 500  # the table really covers every path (guards the walker)
    for action, kind, path, arg in MUTATIONS:
        doc = mutate(envelope(action), kind, path, arg)
        reading = check_reading(dump(doc).encode("utf-8"), "mutation")
        if path[:1] != ("requestId",):
            # Nothing was done to the requestId, so the answer stays correlated.
            assert reading.request_id == REQUEST_ID, (action, kind, path)
        doomed = kind in ("null", "extend") or (kind == "duplicate" and isinstance(path[-1], str))
        doomed |= kind == "retype" or (kind == "delete" and _required(action, path))
        if doomed:
            assert reading.request is None, (action, kind, path, arg)


@FUZZ
@given(data=st.data())
def test_chained_mutations(data: st.DataObject) -> None:
    action = data.draw(st.sampled_from(sorted(ACTIONS)))
    doc: Any = envelope(action)
    for _ in range(data.draw(st.integers(1, 4))):
        if isinstance(doc, Pairs):
            break  # a repeated key was written; further edits would need the pair form
        choices = list(all_mutations_of(doc))
        if not choices:
            break
        kind, path, arg = data.draw(st.sampled_from(choices))
        doc = mutate(doc, kind, path, arg)
    check_reading(dump(doc).encode("utf-8"), "chained_mutation")


def all_mutations_of(doc: Any) -> Iterator[tuple[str, Path, Any]]:
    for path in paths(doc):
        yield "delete", path, None
        yield "duplicate", path, None
        yield "null", path, None
        for value in RETYPES.values():
            yield "retype", path, value
    for path in objects(doc):
        yield "extend", path, None


# --------------------------------------------------------------------------- blind inputs

@FUZZ
@given(body=st.binary(max_size=2048))
def test_random_bytes(body: bytes) -> None:
    check_reading(body, "random_bytes")


json_scalars = (st.none() | st.booleans() | st.integers(-(2**80), 2**80)
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40))
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=30,
)


@FUZZ
@given(doc=json_values)
def test_random_json_documents(doc: Any) -> None:
    check_reading(json.dumps(doc).encode("utf-8"), "random_json")


@FUZZ
@given(action=st.sampled_from(sorted(ACTIONS) + ["sign", "Message.Post", ""]), args=json_values)
def test_random_args(action: str, args: Any) -> None:
    reading = check_reading(json.dumps(envelope(action, args)).encode("utf-8"), "random_args")
    assert reading.request_id == REQUEST_ID


@FUZZ
@given(data=st.data())
def test_invalid_utf8_spliced_anywhere(data: st.DataObject) -> None:
    action = data.draw(st.sampled_from(sorted(ACTIONS)))
    body = dump(envelope(action)).encode("utf-8")
    at = data.draw(st.integers(0, len(body)))
    bad = data.draw(st.sampled_from([
        b"\xff", b"\xc0\xaf", b"\xe0\x80\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80",
        b"\xc3", b"\x00",
    ]))
    reading = check_reading(body[:at] + bad + body[at:], "invalid_utf8")
    assert reading.request is None  # no invalid byte sequence is a valid request


def test_a_byte_order_mark_is_not_json() -> None:
    # U+FEFF inside a string is a character; in front of the document it is refused (I6).
    reading = check_reading(b"\xef\xbb\xbf" + dump(envelope("message.post")).encode(), "invalid_utf8")
    assert reading.request_id is None


# --------------------------------------------------------------------------- pointed inputs

def _integer_slots(action: str) -> list[Path]:
    base = envelope(action)
    return [p for p in paths(base) if _json_type(_get(base, p)) == "int"] + [("args", "limit")]


@FUZZ
@given(data=st.data(), number=st.one_of(
    st.integers(-(2**70), 2**70), st.sampled_from([2**63 - 1, 2**63, -(2**63), -(2**63) - 1, -1, 0]),
))
def test_huge_and_negative_numbers(data: st.DataObject, number: int) -> None:
    action = data.draw(st.sampled_from(sorted(ACTIONS)))
    path = data.draw(st.sampled_from(_integer_slots(action)))
    doc = envelope(action)
    _get(doc, path[:-1])[path[-1]] = number
    # Also spelled as the literal digits with an exponent/fraction, which json.dumps won't.
    text = dump(doc)
    check_reading(text.encode(), "numbers")
    check_reading(text.replace(str(number), f"{number}.0", 1).encode(), "numbers")
    check_reading(text.replace(str(number), f"{number}e400", 1).encode(), "numbers")


def _string_slots(action: str) -> list[Path]:
    base = envelope(action)
    return [p for p in paths(base) if _json_type(_get(base, p)) == "str"]


@FUZZ
@given(data=st.data(), size=st.sampled_from([0, 1, 127, 128, 129, 65536, 65537, 300_000, 1 << 20]),
       fill=st.sampled_from(["a", "é", "😀", "\\u0000", "\\\"", " "]))
def test_long_strings(data: st.DataObject, size: int, fill: str) -> None:
    action = data.draw(st.sampled_from(sorted(ACTIONS)))
    path = data.draw(st.sampled_from(_string_slots(action)))
    marker = "@@MARK@@"
    doc = envelope(action)
    _get(doc, path[:-1])[path[-1]] = marker
    # Spliced as raw JSON text so escapes like \u0000 stay escapes.
    text = dump(doc).replace(json.dumps(marker, ensure_ascii=False), '"' + fill * size + '"', 1)
    assert "@@" not in text
    check_reading(text.encode("utf-8"), "long_strings")


SURROGATES = ["\\ud800", "\\udfff", "\\udbff\\u0041", "\\ud83d", "\\ude00\\ud83d", "\\uDC00"]


@FUZZ
@given(data=st.data(), escape=st.sampled_from(SURROGATES), in_key=st.booleans())
def test_lone_surrogate_escapes(data: st.DataObject, escape: str, in_key: bool) -> None:
    action = data.draw(st.sampled_from(sorted(ACTIONS)))
    doc = envelope(action)
    if in_key:
        where = data.draw(st.sampled_from(list(objects(doc))))
        _get(doc, where)["@@K@@"] = 1
        text = dump(doc).replace('"@@K@@"', f'"k{escape}"', 1)
    else:
        path = data.draw(st.sampled_from(_string_slots(action)))
        _get(doc, path[:-1])[path[-1]] = "@@V@@"
        text = dump(doc).replace('"@@V@@"', f'"v{escape}"', 1)
    assert "@@" not in text  # the splice happened
    reading = check_reading(text.encode("utf-8"), "surrogates")
    assert reading.request is None


@pytest.mark.parametrize("depth", [17, 1000, 10_000, 100_000])
@pytest.mark.parametrize("shape", ["array", "object"])
@pytest.mark.parametrize("where", ["top", "args", "requestId"])
def test_deep_nesting(depth: int, shape: str, where: str) -> None:
    opener, closer = ("[", "]") if shape == "array" else ('{"a":', "}")
    deep = opener * depth + "1" + closer * depth
    if where == "top":
        text = deep
    else:
        member = "args" if where == "args" else "requestId"
        doc = envelope("message.post")
        doc[member] = "@@D@@"
        text = dump(doc).replace('"@@D@@"', deep, 1)
        assert "@@" not in text
    reading = check_reading(text.encode(), "nesting")
    assert reading.request is None
    # Also unbalanced: opened 10,000 deep and never closed.
    check_reading((opener * depth).encode(), "nesting")


# --------------------------------------------------------------------------- responses

_PK = ["79be667ef9dcbbac55a06295ce870b07029bfcdb2dce28d959f2815b16f81798",
       "c6047f9441ed7d6d3045406e95c07cd85c778e4b8cef3ca7abac09b95c709ee5"]
#: Text an envelope can carry: every scalar value but lone surrogates (a Verdict refuses those).
texts = st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=200)
request_ids = st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7e), min_size=1,
                      max_size=128)


def _succeeded_verdicts() -> st.SearchStrategy[Verdict]:
    """Outcomes of all nine actions, built by the contract's own strict reader from the
    vectors with fuzzed values where the shape allows free values."""

    @st.composite
    def build(draw: st.DrawFn) -> Verdict:
        action = draw(st.sampled_from(sorted(ACTIONS)))
        outcome = copy.deepcopy(VALID_OUTCOMES[action])
        if action == "channel.read":
            n = draw(st.integers(0, 3))
            outcome["messages"] = [
                {**outcome["messages"][0], "content": draw(texts),
                 "created_at": draw(st.integers(0, 2**63 - 1)),
                 "tags": draw(st.lists(st.lists(texts, max_size=3), max_size=3))}
                for _ in range(n)
            ]
            if draw(st.booleans()):
                del outcome["nextCursor"]
        elif "createdAt" in outcome:
            outcome["createdAt"] = draw(st.integers(0, 2**63 - 1))
            outcome["kind"] = draw(st.integers(0, 65535))
        elif action == "agents.update":
            outcome["updatedFields"] = draw(st.lists(texts, max_size=5))
        wire = {"type": "broker_result", "protocolVersion": 1, "requestId": "r", "status":
                "succeeded", "action": action, "outcome": outcome}
        parsed = parse_response(json.dumps(wire, ensure_ascii=False).encode("utf-8"))
        assert parsed.outcome is not None
        return Verdict.succeeded(action, parsed.outcome)

    return build()


@st.composite
def _error_verdicts(draw: st.DrawFn) -> Verdict:
    code = draw(st.sampled_from(list(ErrorCode)))
    status = draw(st.sampled_from(sorted(PAIRING[code], key=lambda s: s.value)))
    message = draw(texts | st.sampled_from(list(MESSAGES.values())))
    return Verdict(status=status, code=code, message=message)


@FUZZ
@given(request_id=request_ids, verdict=st.one_of(_succeeded_verdicts(), _error_verdicts()))
def test_encoded_verdicts_reparse(request_id: str, verdict: Verdict) -> None:
    _counts["verdicts"] = _counts.get("verdicts", 0) + 1
    body = encode_response(request_id, verdict)
    back = parse_response(body)
    assert back.request_id == request_id
    assert (back.status, back.action, back.outcome, back.code, back.message) == (
        verdict.status, verdict.action, verdict.outcome, verdict.code, verdict.message)
    assert not back.replayed


def test_a_verdict_that_exists_encodes() -> None:
    try:
        verdict = Verdict.failed(ErrorCode.ACTION_FAILED, "relay said \ud800")
    except (AssertionError, ValueError):
        return  # refused at construction: the fix
    parse_response(encode_response(REQUEST_ID, verdict))
