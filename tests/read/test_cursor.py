"""Cursors: round trip, every tampered byte refused, foreign scope refused, expiry, restart."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.hostkey import HostKeyError
from daemon.relay.cursor import (
    CURSOR_TTL_SECONDS,
    KEY_FILE_NAME,
    MAX_CLOCK_SKEW_SECONDS,
    CursorCodec,
    CursorScope,
    InvalidCursor,
    Position,
)

NOW = 1_787_675_388
SCOPE = CursorScope(agent="a" * 64, channel_id="0b7b2f0e-1c5e-4f6a-9d3c-2a1b0c9d8e7f", mentions_only=False, root_event_id=None)
POS = Position(created_at=1_787_675_000, event_id="0123456789abcdef" * 4)
_PRINTABLE_NO_SPACE = {chr(c) for c in range(0x21, 0x7F)}


@pytest.fixture
def codec(tmp_path: Path) -> CursorCodec:
    return CursorCodec.open(tmp_path)


def test_round_trip_and_shape(codec: CursorCodec) -> None:
    token = codec.encode(POS, SCOPE, now=NOW)
    assert 1 <= len(token.encode("ascii")) <= 256
    assert set(token) <= _PRINTABLE_NO_SPACE
    assert codec.decode(token, SCOPE, now=NOW) == POS


@settings(max_examples=50, deadline=None)
@given(created_at=st.integers(0, 2**64 - 1), event_id=st.binary(min_size=32, max_size=32), now=st.integers(0, 2**40))
def test_round_trip_any_position(created_at: int, event_id: bytes, now: int) -> None:
    codec = CursorCodec(b"k" * 32)
    pos = Position(created_at=created_at, event_id=event_id.hex())
    assert codec.decode(codec.encode(pos, SCOPE, now=now), SCOPE, now=now) == pos


def test_every_tampered_character_is_refused(codec: CursorCodec) -> None:
    token = codec.encode(POS, SCOPE, now=NOW)
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    for i, ch in enumerate(token):
        for replacement in (alphabet[(alphabet.index(ch) + 1) % 64], alphabet[(alphabet.index(ch) + 17) % 64]):
            tampered = token[:i] + replacement + token[i + 1 :]
            with pytest.raises(InvalidCursor):
                codec.decode(tampered, SCOPE, now=NOW)


@pytest.mark.parametrize(
    "bad",
    ["", " ", "x", "é" * 108, "A" * 107, "A" * 109, "A" * 300, "=" * 108, "A" * 104 + "====", "\x00" * 108, "A" * 107 + " "],
)
def test_malformed_tokens_are_refused(codec: CursorCodec, bad: str) -> None:
    with pytest.raises(InvalidCursor):
        codec.decode(bad, SCOPE, now=NOW)


def test_truncated_and_extended_tokens_are_refused(codec: CursorCodec) -> None:
    token = codec.encode(POS, SCOPE, now=NOW)
    for n in range(len(token)):
        with pytest.raises(InvalidCursor):
            codec.decode(token[:n], SCOPE, now=NOW)
    with pytest.raises(InvalidCursor):
        codec.decode(token + "A", SCOPE, now=NOW)


@pytest.mark.parametrize(
    "other",
    [
        CursorScope(agent="b" * 64, channel_id=SCOPE.channel_id, mentions_only=False, root_event_id=None),
        CursorScope(agent=SCOPE.agent, channel_id="1b7b2f0e-1c5e-4f6a-9d3c-2a1b0c9d8e7f", mentions_only=False, root_event_id=None),
        CursorScope(agent=SCOPE.agent, channel_id=SCOPE.channel_id, mentions_only=True, root_event_id=None),
        CursorScope(agent=SCOPE.agent, channel_id=SCOPE.channel_id, mentions_only=False, root_event_id="e" * 64),
    ],
    ids=["principal", "channel", "mentions", "thread"],
)
def test_foreign_scope_is_refused(codec: CursorCodec, other: CursorScope) -> None:
    token = codec.encode(POS, SCOPE, now=NOW)
    with pytest.raises(InvalidCursor):
        codec.decode(token, other, now=NOW)
    # and the other way round
    with pytest.raises(InvalidCursor):
        codec.decode(codec.encode(POS, other, now=NOW), SCOPE, now=NOW)


def test_expiry_with_an_injected_clock(codec: CursorCodec) -> None:
    token = codec.encode(POS, SCOPE, now=NOW)
    assert codec.decode(token, SCOPE, now=NOW + CURSOR_TTL_SECONDS) == POS
    with pytest.raises(InvalidCursor):
        codec.decode(token, SCOPE, now=NOW + CURSOR_TTL_SECONDS + 1)
    assert codec.decode(token, SCOPE, now=NOW - MAX_CLOCK_SKEW_SECONDS) == POS
    with pytest.raises(InvalidCursor):
        codec.decode(token, SCOPE, now=NOW - MAX_CLOCK_SKEW_SECONDS - 1)


def test_another_hosts_key_is_refused(tmp_path: Path, codec: CursorCodec) -> None:
    other = tmp_path / "other"
    other.mkdir()
    token = CursorCodec.open(other).encode(POS, SCOPE, now=NOW)
    with pytest.raises(InvalidCursor):
        codec.decode(token, SCOPE, now=NOW)


def test_still_valid_after_a_restart(tmp_path: Path) -> None:
    token = CursorCodec.open(tmp_path).encode(POS, SCOPE, now=NOW)
    again = CursorCodec.open(tmp_path)
    assert again.decode(token, SCOPE, now=NOW + 60) == POS
    key = tmp_path / KEY_FILE_NAME
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert key.stat().st_size == 32
    assert [p.name for p in tmp_path.iterdir()] == [KEY_FILE_NAME]  # no temporary left behind


def test_unusable_key_files_are_refused_with_the_path(tmp_path: Path) -> None:
    key = tmp_path / KEY_FILE_NAME
    key.write_bytes(b"short")
    os.chmod(key, 0o600)
    with pytest.raises(HostKeyError, match=KEY_FILE_NAME):
        CursorCodec.open(tmp_path)
    key.write_bytes(b"k" * 32)
    os.chmod(key, 0o644)
    with pytest.raises(HostKeyError, match="readable by others"):
        CursorCodec.open(tmp_path)


def test_repr_redacts_the_key(tmp_path: Path) -> None:
    codec = CursorCodec.open(tmp_path)
    key = (tmp_path / KEY_FILE_NAME).read_bytes()
    assert key.hex() not in repr(codec) and str(key) not in repr(codec)
    assert "redacted" in repr(codec)


def test_invalid_cursor_carries_nothing(codec: CursorCodec) -> None:
    with pytest.raises(InvalidCursor) as info:
        codec.decode("A" * 108, SCOPE, now=NOW)
    assert str(info.value) == "" and info.value.args == ()


def test_scopes_whose_fields_run_together_are_still_different_scopes(codec: CursorCodec) -> None:
    # The scope's fields are length-prefixed: a channel id that ends where another scope's
    # mentionsOnly flag and rootEventId begin must not read as that scope.
    root = "0" * 63 + "1"
    threaded = CursorScope(agent="a" * 64, channel_id="x", mentions_only=True, root_event_id=root)
    lookalike = CursorScope(agent="a" * 64, channel_id="x1" + root[:63], mentions_only=True,
                            root_event_id=None)
    token = codec.encode(POS, threaded, now=NOW)
    assert codec.decode(token, threaded, now=NOW) == POS
    with pytest.raises(InvalidCursor):
        codec.decode(token, lookalike, now=NOW)


@pytest.mark.parametrize("fields, error", [
    ({"agent": "A" * 64}, ValueError),          # the contract's spelling is lowercase
    ({"agent": "a" * 63}, ValueError),
    ({"channel_id": ""}, ValueError),
    ({"mentions_only": 1}, TypeError),           # 1 would MAC as True's "1"
    ({"root_event_id": "E" * 64}, ValueError),
    ({"root_event_id": ""}, ValueError),         # "" would MAC as no root at all
])
def test_a_scope_in_another_spelling_is_a_programmer_error(fields: dict[str, object],
                                                           error: type[Exception]) -> None:
    # A cursor is bound to its scope's exact bytes: a scope built from an un-normalized
    # value (uppercase hex, a truthy int, an empty root) is our bug, refused at once,
    # never a cursor bound to a spelling no other read uses.
    base: dict[str, object] = {"agent": SCOPE.agent, "channel_id": SCOPE.channel_id,
                               "mentions_only": False, "root_event_id": None}
    with pytest.raises(error):
        CursorScope(**{**base, **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize("created_at", [-1, 2**64, True])
def test_a_position_out_of_a_cursors_range_is_a_programmer_error(created_at: object) -> None:
    with pytest.raises(ValueError):
        Position(created_at=created_at, event_id="0" * 64)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Position(created_at=1, event_id="A" * 64)


@pytest.mark.parametrize("now", [-1, 2**64, True, 1.0])
def test_an_issue_time_out_of_range_is_a_programmer_error(now: object) -> None:
    codec = CursorCodec(b"k" * 32)
    with pytest.raises(ValueError):
        codec.encode(POS, SCOPE, now=now)  # type: ignore[arg-type]


@pytest.mark.parametrize("key", [b"", b"k" * 31, b"k" * 33, "k" * 32, bytearray(b"k" * 32)])
def test_a_mac_key_of_another_size_or_type_is_refused(key: object) -> None:
    with pytest.raises(ValueError):
        CursorCodec(key)  # type: ignore[arg-type]


def test_the_lifetime_and_the_skew_are_the_documented_ones() -> None:
    # docs/protocol.md: "24 hours from issue ...; 60 s of clock skew tolerated". The
    # expiry test reads both from the module's constants, so it cannot see them change.
    codec = CursorCodec(b"k" * 32)
    token = codec.encode(POS, SCOPE, now=NOW)
    assert codec.decode(token, SCOPE, now=NOW + 24 * 3600) == POS
    with pytest.raises(InvalidCursor):
        codec.decode(token, SCOPE, now=NOW + 24 * 3600 + 1)
    assert codec.decode(token, SCOPE, now=NOW - 60) == POS
    with pytest.raises(InvalidCursor):
        codec.decode(token, SCOPE, now=NOW - 61)
