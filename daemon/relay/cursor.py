"""Host-issued read cursors: opaque, MAC-bound to who asked and what they asked for.

Rules (agent-broker.md "channel.read"; design.md "Reads and cursors"):

1. A cursor is 1-256 bytes of printable ASCII with no spaces, issued only by this host.
   The agent never parses, compares or synthesizes one; the host owns its meaning.
2. It carries a *position* — the (created_at, id) of the last event the previous page
   delivered — and the second it was issued, for expiry.
3. It is bound to its *scope*: the principal's agent pubkey, the channel, and the filter
   (mentionsOnly, rootEventId). The scope is not carried in the cursor; it is fed to the
   MAC as associated data. So a cursor used by another agent, on another channel or with
   another filter fails the MAC exactly like a forged one, and the cursor reveals nothing
   about who it was issued to. The agent (not the credential) is bound, so a cursor
   survives a credential rotation for the same agent.
4. HMAC-SHA256 under a 32-byte host key in `<state_dir>/cursor-mac.key` (0600, created
   once, atomically, refused when unusable: daemon/hostkey.py), so a cursor stays
   valid after a restart. MACs are compared only with `hmac.compare_digest`.
5. Every failure of untrusted input — bad shape, bad base64, wrong length, unknown
   version, bad MAC, foreign scope, expired, issued in the future — raises the one opaque
   `InvalidCursor`, with no message and no fields (as Fernet's InvalidToken), so neither
   caller nor attacker can tell the causes apart. Programmer errors raise ValueError /
   TypeError with detail.
6. Bytes are read before the MAC is checked only by `_split_unverified`, which looks at
   nothing but the length and alphabet; the position and issue time are unpacked only
   after `compare_digest` succeeds.

Layout (binary, then base64url without padding; 81 bytes -> 108 ASCII characters):

    offset size  field
    0      1     version (0x01)
    1      8     issued_at, unsigned big-endian seconds
    9      8     position created_at, unsigned big-endian seconds
    17     32    position event id (raw bytes of the 64-hex id)
    49     32    HMAC-SHA256(key, DOMAIN || bytes[0:49] || scope_bytes)

scope_bytes = length-prefixed (u16 big-endian) UTF-8 of: agent hex, channel id,
"1"/"0" for mentionsOnly, rootEventId hex or "" — unambiguous whatever the values.

WARNING: keep `_LAYOUT`, `_BODY_LEN`, `_TOKEN_LEN` and the layout table above in sync;
changing any of them is a new VERSION (old cursors then fail as invalid, which is the
honest answer: the agent starts again from the newest page).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import struct
from dataclasses import dataclass
from pathlib import Path

from daemon.hostkey import HOST_KEY_BYTES, load_or_create

__all__ = [
    "CURSOR_TTL_SECONDS",
    "MAX_CLOCK_SKEW_SECONDS",
    "KEY_FILE_NAME",
    "CursorCodec",
    "CursorScope",
    "InvalidCursor",
    "Position",
]

#: A cursor older than this is refused. 24 hours: long enough for an agent that polls its
#: mentions a few times a day, short enough that a leaked cursor soon stops working.
CURSOR_TTL_SECONDS = 24 * 60 * 60
#: A cursor issued this far in the future (host clock stepped back) is still accepted;
#: beyond it, refused. Same allowance as Fernet's.
MAX_CLOCK_SKEW_SECONDS = 60
#: The host MAC key's file name under the state directory.
KEY_FILE_NAME = "cursor-mac.key"
_KEY_LEN = HOST_KEY_BYTES

_VERSION = 1
#: version, issued_at, created_at, id
_LAYOUT = struct.Struct(">BQQ32s")
_MAC_LEN = 32
_BODY_LEN = _LAYOUT.size  # 49
_RAW_LEN = _BODY_LEN + _MAC_LEN  # 81
#: base64url of 81 bytes without padding: 81 is a multiple of 3, so exactly 108 characters.
_TOKEN_LEN = (_RAW_LEN // 3) * 4
#: Domain separation: this key MACs cursors and nothing else.
_DOMAIN = b"buzz-broker/cursor/v1\x00"
_B64URL_ALPHABET = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
_U64_MAX = 2**64 - 1
_HEX = frozenset("0123456789abcdef")

# The spec's cursor bound (agent-broker.md: 1-256 bytes); ours is well inside it.
assert _TOKEN_LEN <= 256


class InvalidCursor(Exception):
    """The one opaque failure for every cause of a cursor being refused. Carries nothing."""

    def __init__(self) -> None:
        super().__init__()


def _require_hex64(name: str, value: str) -> None:
    if not isinstance(value, str) or len(value) != 64 or not set(value) <= _HEX:
        raise ValueError(f"{name} must be 64 lowercase hex characters")


@dataclass(frozen=True, slots=True, kw_only=True)
class Position:
    """Where a page ended: the last delivered event's (created_at, id). The next page holds
    events strictly after it in (created_at DESC, id ASC) order."""

    created_at: int
    event_id: str

    def __post_init__(self) -> None:
        if type(self.created_at) is not int or not 0 <= self.created_at <= _U64_MAX:
            raise ValueError("created_at must be an int in 0..2**64-1")
        _require_hex64("event_id", self.event_id)


@dataclass(frozen=True, slots=True, kw_only=True)
class CursorScope:
    """What a cursor was issued for. Values are the contract's normalized spellings."""

    agent: str
    channel_id: str
    mentions_only: bool
    root_event_id: str | None

    def __post_init__(self) -> None:
        _require_hex64("agent", self.agent)
        if not isinstance(self.channel_id, str) or not self.channel_id:
            raise ValueError("channel_id must be a non-empty string")
        if type(self.mentions_only) is not bool:
            raise TypeError("mentions_only must be a bool")
        if self.root_event_id is not None:
            _require_hex64("root_event_id", self.root_event_id)

    def to_bytes(self) -> bytes:
        parts = (
            self.agent,
            self.channel_id,
            "1" if self.mentions_only else "0",
            self.root_event_id or "",
        )
        out = bytearray()
        for part in parts:
            data = part.encode("utf-8")
            out += struct.pack(">H", len(data)) + data
        return bytes(out)


def _split_unverified(token: object) -> tuple[bytes, bytes]:
    """Shape check and base64url decode, nothing more: returns (body, mac) NOT yet
    authenticated. Raises InvalidCursor for any shape fault."""
    if not isinstance(token, str) or len(token) != _TOKEN_LEN:
        raise InvalidCursor()
    try:
        raw_token = token.encode("ascii")
    except UnicodeEncodeError:
        raise InvalidCursor() from None
    if not set(raw_token) <= _B64URL_ALPHABET:
        raise InvalidCursor()
    try:
        raw = base64.urlsafe_b64decode(raw_token)
    except (binascii.Error, ValueError):  # pragma: no cover - alphabet and length checked
        raise InvalidCursor() from None
    if len(raw) != _RAW_LEN:  # pragma: no cover - follows from the token length
        raise InvalidCursor()
    return raw[:_BODY_LEN], raw[_BODY_LEN:]


class CursorCodec:
    """Issues and checks cursors under the host MAC key. Create with `CursorCodec.open`."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, bytes) or len(key) != _KEY_LEN:
            raise ValueError(f"cursor MAC key must be {_KEY_LEN} bytes")
        self._key = key

    def __repr__(self) -> str:
        return "CursorCodec(key=<redacted>)"

    @classmethod
    def open(cls, state_dir: Path | str) -> CursorCodec:
        """Load the host MAC key from `<state_dir>/cursor-mac.key`, creating it on first use.

        Creation is atomic, so two processes racing on first use end up with one key and no
        half-written file (daemon/hostkey.py).

        Raises:
            HostKeyError: the file exists but has the wrong size, is not a regular file,
                or is readable by group/other; or the directory cannot be written.
        """
        return cls(load_or_create(state_dir, KEY_FILE_NAME, what="cursor MAC key"))

    def encode(self, position: Position, scope: CursorScope, *, now: int) -> str:
        """The cursor for `position`, bound to `scope`, issued at `now` (seconds)."""
        if type(now) is not int or not 0 <= now <= _U64_MAX:
            raise ValueError("now must be an int in 0..2**64-1")
        body = _LAYOUT.pack(_VERSION, now, position.created_at, bytes.fromhex(position.event_id))
        raw = body + self._mac(body, scope)
        return base64.urlsafe_b64encode(raw).decode("ascii")

    def decode(self, token: str, scope: CursorScope, *, now: int) -> Position:
        """The position a cursor carries, if this host issued it for `scope` within the TTL.

        Raises:
            InvalidCursor: for every cause (see the module rules); never anything else for
                any input string.
        """
        body, mac = _split_unverified(token)
        if not hmac.compare_digest(mac, self._mac(body, scope)):
            raise InvalidCursor()
        # Authenticated from here on: the bytes are ours.
        version, issued_at, created_at, raw_id = _LAYOUT.unpack(body)
        if version != _VERSION:
            raise InvalidCursor()
        if issued_at > now + MAX_CLOCK_SKEW_SECONDS or now - issued_at > CURSOR_TTL_SECONDS:
            raise InvalidCursor()
        return Position(created_at=created_at, event_id=raw_id.hex())

    def _mac(self, body: bytes, scope: CursorScope) -> bytes:
        return hmac.new(self._key, _DOMAIN + body + scope.to_bytes(), hashlib.sha256).digest()
