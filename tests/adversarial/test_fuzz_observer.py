"""Fuzzing observer.emit's two pure steps.

Invariants (style.md #22):
- for ANY frames array, `read_request` answers (a Request or `invalid_request`), and
  whatever it accepts holds 1-256 frames whose compact `{"frames":...}` is at most 65,535
  bytes, each payload kept byte for byte;
- for ANY payload string, the ObserverEvent the host builds is one JSON object whose
  `payload` is the payload spliced in (when it is JSON) or the payload as a string, and
  whose other members are the host's.
"""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from buzzwire.contract import (
    MAX_FRAMES, MAX_OBSERVER_BYTES, ErrorCode, ObserverEmitArgs, compact_json, read_request,
)
from daemon.operations.observer_emit import is_json_text, observer_event
from tests.adversarial import scaled
from tests.contract.vectors import CHANNEL, body, envelope

FUZZ = settings(max_examples=scaled(150, 3000), deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=300)
_payload = st.one_of(
    _text,
    # Large ones: a short random text repeated up to past the 65,535-byte bound.
    st.tuples(_text.filter(bool), st.integers(1, 70_000)).map(lambda t: (t[0] * t[1])[:70_000]),
    st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | _text,
                 lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=4),
                 max_leaves=20).map(lambda v: json.dumps(v)),
)
_frame = st.fixed_dictionaries({"kind": _text, "payload": _payload})


def len_compact(value: object) -> int:
    return len(compact_json(value))


@FUZZ
@given(st.lists(_frame, max_size=MAX_FRAMES + 4))
def test_any_frames_are_judged_and_what_is_accepted_is_in_bounds(frames: list[dict[str, str]]) -> None:
    reading = read_request(body(envelope("observer.emit", {"frames": frames})))
    if reading.error is not None:
        assert reading.error.code is ErrorCode.INVALID_REQUEST
        return
    assert reading.request is not None
    args = reading.request.args
    assert isinstance(args, ObserverEmitArgs)
    assert 1 <= len(args.frames) <= MAX_FRAMES
    assert len_compact({"frames": [{"kind": f.kind, "payload": f.payload}
                                    for f in args.frames]}) <= MAX_OBSERVER_BYTES
    assert [f.payload for f in args.frames] == [f["payload"] for f in frames]


@FUZZ
@given(_payload, _text.filter(lambda k: bool(k.strip())), st.integers(1, 2**63 - 1),
       st.sampled_from([CHANNEL, None]))
def test_any_payload_makes_one_json_object(payload: str, kind: str, seq: int,
                                           channel: str | None) -> None:
    text = observer_event(seq=seq, timestamp="2026-12-01T21:00:41.500Z", kind=kind,
                          payload=payload, channel_id=channel)
    # A spliced payload may hold an integer past int()'s 4,300 digits: kept as its digits.
    event = json.loads(text, parse_int=lambda d: int(d) if len(d) <= 4300 else d)
    assert list(event) == ["seq", "timestamp", "kind", "channelId", "payload"]
    assert (event["seq"], event["kind"], event["channelId"]) == (seq, kind, channel)
    if is_json_text(payload):
        assert text.endswith(f',"payload":{payload}}}')  # spliced byte for byte
    else:
        assert event["payload"] == payload


def test_an_integer_of_any_length_is_json_and_spliced() -> None:
    # RFC 8259 puts no bound on an integer's digits; Python's int() refuses past 4,300.
    payload = '{"n":' + "1" * 5000 + "}"
    assert is_json_text(payload)
    text = observer_event(seq=1, timestamp="2026-12-01T21:00:41.500Z", kind="k",
                          payload=payload, channel_id=None)
    assert text.endswith(f',"payload":{payload}}}')
