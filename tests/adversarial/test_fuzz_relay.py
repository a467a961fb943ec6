"""Fuzz for the NIP-01 reader that faces the relay (a hostile relay is in the threat model).

Whatever a relay sends in a frame, `parse_relay_message` gives one of its messages or a
`RelayProtocolError`; whatever an EVENT carries, `SignedEvent.from_json_obj` gives an
event or a ValueError, and `verify_signed` a bool. Nothing else escapes to the pool's
reader task, which would otherwise end that connection's reads for every agent on it.
"""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from buzzwire.nostr import SignedEvent, verify_signed
from daemon.relay.protocol import RelayProtocolError, parse_relay_message

leaf = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=70) | st.sampled_from(["EVENT", "OK", "EOSE", "CLOSED", "AUTH"]))
values = st.recursive(leaf, lambda inner: st.lists(inner, max_size=5)
                      | st.dictionaries(st.text(max_size=10), inner, max_size=5), max_leaves=20)
verbs = st.sampled_from(["EVENT", "OK", "EOSE", "CLOSED", "NOTICE", "AUTH", "COUNT", ""])
EVENT = {"id": "a" * 64, "pubkey": "79be667ef9dcbbac55a06295ce870b07029bfcdb2dce28d959f2815b16f81798",
         "created_at": 1_700_000_000, "kind": 9, "tags": [["h", "c"]], "content": "hi",
         "sig": "b" * 128}


def _read(frame: str | bytes) -> None:
    try:
        parse_relay_message(frame)
    except RelayProtocolError:
        pass


@given(st.binary(max_size=200))
@settings(max_examples=300, deadline=None)
def test_any_bytes_read_or_are_refused(frame: bytes) -> None:
    _read(frame)


@given(verb=verbs, rest=st.lists(values, max_size=4))
@settings(max_examples=500, deadline=None)
def test_any_array_under_any_verb_reads_or_is_refused(verb: str, rest: list[object]) -> None:
    _read(json.dumps([verb, *rest]))


@given(member=st.sampled_from(sorted(EVENT)), value=values)
@settings(max_examples=500, deadline=None)
def test_any_value_in_any_event_member_is_an_event_or_a_value_error(
        member: str, value: object) -> None:
    frame = json.dumps(["EVENT", "sub", {**EVENT, member: value}])
    message = parse_relay_message(frame)
    try:
        event = SignedEvent.from_json_obj(message.event)  # type: ignore[union-attr]
    except ValueError:
        return
    assert isinstance(event.kind, int) and not isinstance(event.kind, bool)
    assert isinstance(event.created_at, int) and not isinstance(event.created_at, bool)
    assert verify_signed(event) in (True, False)
