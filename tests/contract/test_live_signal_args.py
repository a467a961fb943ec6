"""observer.emit and liveness.ping on the wire (NIP-BA "Actions", "Live signals"): the
argument shapes, the frame bounds with the compact-encoding rule, and the count outcome.
Tests assert codes, pointers and values, never message text."""

from __future__ import annotations

import json
from typing import Any

import pytest

from buzzwire.contract import (
    MAX_FRAMES, MAX_OBSERVER_BYTES, ContractError, ErrorCode, LivenessPingArgs,
    ObserverEmitArgs, ObserverEmitOutcome, ObserverFrame, compact_json, parse_response,
    read_request,
)
from tests.contract.vectors import CHANNEL, REQUEST_ID, body, envelope

I = ErrorCode.INVALID_REQUEST


def len_compact(value: object) -> int:
    return len(compact_json(value))


def read(action: str, args: Any) -> Any:
    reading = read_request(body(envelope(action, args)))
    assert reading.request_id == REQUEST_ID
    return reading


def fault(action: str, args: Any) -> str:
    reading = read(action, args)
    assert reading.error is not None and reading.error.code is I, reading
    return str(reading.error.pointer)


def frames(*pairs: tuple[str, str]) -> dict[str, Any]:
    return {"frames": [{"kind": k, "payload": p} for k, p in pairs]}


# ------------------------------------------------------------------ observer.emit


def test_frames_are_read_with_kind_trimmed_and_payload_kept_byte_for_byte() -> None:
    payload = '  {"a": 1}\n'
    args = read("observer.emit", frames(("  acp_read\t", payload))).request.args
    assert args == ObserverEmitArgs(frames=(ObserverFrame(kind="acp_read", payload=payload),))


@pytest.mark.parametrize("count", [1, MAX_FRAMES])
def test_one_to_256_frames(count: int) -> None:
    args = read("observer.emit", frames(*[("k", "p")] * count)).request.args
    assert len(args.frames) == count


def test_the_frame_bound_is_nip_bas_256() -> None:
    # NIP-BA's number written out: the tests above take it from MAX_FRAMES, so they would
    # follow a changed constant; this one holds the contract to the spec's "1-256 frames".
    assert len(read("observer.emit", frames(*[("k", "p")] * 256)).request.args.frames) == 256
    assert fault("observer.emit", frames(*[("k", "p")] * 257)) == "/args/frames"


@pytest.mark.parametrize(("args", "pointer"), [
    ({"frames": []}, "/args/frames"),                                  # NIP-BA: never empty
    (frames(*[("k", "p")] * (MAX_FRAMES + 1)), "/args/frames"),
    ({}, "/args/frames"),
    ({"frames": [{"kind": "k"}]}, "/args/frames/0/payload"),
    ({"frames": [{"payload": "p"}]}, "/args/frames/0/kind"),
    ({"frames": [{"kind": "k", "payload": "p", "seq": 1}]}, "/args/frames/0/seq"),
    ({"frames": [{"kind": "k", "payload": None}]}, "/args/frames/0/payload"),
    ({"frames": [{"kind": 7, "payload": "p"}]}, "/args/frames/0/kind"),   # not a Nostr kind
    ({"frames": [{"kind": "k", "payload": {"a": 1}}]}, "/args/frames/0/payload"),
    (frames(("k", "   \n")), "/args/frames/0/payload"),               # no non-whitespace
    (frames(("k", "")), "/args/frames/0/payload"),
    (frames((" ", "p")), "/args/frames/0/kind"),
    (frames(("x" * 301, "p")), "/args/frames/0/kind"),                # scalar: 300
    ({"frames": {"kind": "k", "payload": "p"}}, "/args/frames"),
    ({"frames": [["k", "p"]]}, "/args/frames/0"),
    ({"frames": [{"kind": "k", "payload": "p"}], "channelId": CHANNEL}, "/args/channelId"),
])
def test_malformed_frames_are_invalid_request(args: dict[str, Any], pointer: str) -> None:
    assert fault("observer.emit", args) == pointer


def test_a_300_scalar_kind_is_accepted() -> None:
    assert read("observer.emit", frames(("é" * 300, "p"))).error is None


def _overhead(kind: str = "k") -> int:
    return len_compact({"frames": [{"kind": kind, "payload": ""}]})


def test_the_whole_compact_body_holds_at_65535_bytes_and_not_one_more() -> None:
    fill = MAX_OBSERVER_BYTES - _overhead()
    assert read("observer.emit", frames(("k", "x" * fill))).error is None
    assert fault("observer.emit", frames(("k", "x" * (fill + 1)))) == "/args"


def test_escapes_count_as_the_compact_encoding_writes_them() -> None:
    # `"` and `\\` take two bytes, a control U+0001 six (\\u0001), é two, `/` one.
    for unit, width in (('"', 2), ("\\", 2), ("\x01", 6), ("é", 2), ("/", 1)):
        fill = (MAX_OBSERVER_BYTES - _overhead()) // width
        payload = "y" + unit * (fill - 1) + "y" * ((MAX_OBSERVER_BYTES - _overhead()) - width * (fill - 1) - 1)
        assert len_compact({"frames": [{"kind": "k", "payload": payload}]}) == MAX_OBSERVER_BYTES
        assert read("observer.emit", frames(("k", payload))).error is None, unit
        assert fault("observer.emit", frames(("k", payload + "y"))) == "/args", unit


@pytest.mark.parametrize("char", ["a", "é"])
def test_a_payload_over_its_own_bound_is_refused_at_the_payload(char: str) -> None:
    # A payload's own bound (65,535 bytes, not a post's 65,536) names the payload; the
    # whole-body rule would refuse it too, but at /args, so only the pointer shows it.
    over = char * (MAX_OBSERVER_BYTES // len(char.encode()) + 1)
    assert fault("observer.emit", frames(("k", over))) == "/args/frames/0/payload"


def test_the_size_counts_kinds_as_trimmed() -> None:
    fill = MAX_OBSERVER_BYTES - _overhead()
    assert read("observer.emit", frames(("  k  ", "x" * fill))).error is None


def test_many_frames_share_the_one_bound() -> None:
    each = (MAX_OBSERVER_BYTES // 2)
    assert fault("observer.emit", frames(("k", "x" * each), ("k", "x" * each))) == "/args"


def test_compact_size_matches_the_rule() -> None:
    assert len_compact({"frames": [{"kind": "a", "payload": "\x01\"\\/é\n"}]}) == len(
        '{"frames":[{"kind":"a","payload":"\\u0001\\"\\\\/é\\n"}]}'.encode())


def test_a_constructed_value_is_held_to_the_same_bounds() -> None:
    with pytest.raises(ValueError):
        ObserverEmitArgs(frames=())
    with pytest.raises(ValueError):
        ObserverFrame(kind=" padded ", payload="p")


# ------------------------------------------------------------------ liveness.ping


def test_liveness_args_are_read_and_trimmed() -> None:
    args = read("liveness.ping", {"channelId": CHANNEL.upper(), "turnId": " turn-1 "}).request.args
    assert args == LivenessPingArgs(channel_id=CHANNEL, turn_id="turn-1")


@pytest.mark.parametrize(("args", "pointer"), [
    ({"turnId": "t"}, "/args/channelId"),
    ({"channelId": CHANNEL}, "/args/turnId"),
    ({"channelId": "not-a-uuid", "turnId": "t"}, "/args/channelId"),
    ({"channelId": CHANNEL, "turnId": ""}, "/args/turnId"),
    ({"channelId": CHANNEL, "turnId": "  "}, "/args/turnId"),
    ({"channelId": CHANNEL, "turnId": "t" * 301}, "/args/turnId"),
    ({"channelId": CHANNEL, "turnId": 7}, "/args/turnId"),
    ({"channelId": CHANNEL, "turnId": None}, "/args/turnId"),
    ({"channelId": CHANNEL, "turnId": "t", "sessionId": "s"}, "/args/sessionId"),
])
def test_malformed_liveness_args_are_invalid_request(args: dict[str, Any], pointer: str) -> None:
    assert fault("liveness.ping", args) == pointer


def test_a_300_scalar_turn_id_is_accepted() -> None:
    assert read("liveness.ping", {"channelId": CHANNEL, "turnId": "t" * 300}).error is None


# ------------------------------------------------------------------ the outcome


def _result(outcome: object) -> bytes:
    return json.dumps({"type": "broker_result", "protocolVersion": 1, "requestId": REQUEST_ID,
                       "status": "succeeded", "action": "observer.emit",
                       "outcome": outcome}).encode()


@pytest.mark.parametrize("accepted", [0, 1, 256, 2**32 - 1])
def test_accepted_is_a_u32(accepted: int) -> None:
    assert parse_response(_result({"accepted": accepted})).outcome == ObserverEmitOutcome(
        accepted=accepted)


@pytest.mark.parametrize("outcome", [
    {"accepted": -1}, {"accepted": 2**32}, {"accepted": True}, {"accepted": 1.0},
    {"accepted": "1"}, {}, {"accepted": 1, "frames": []},
])
def test_other_outcomes_are_refused(outcome: object) -> None:
    with pytest.raises(ContractError):
        parse_response(_result(outcome))
