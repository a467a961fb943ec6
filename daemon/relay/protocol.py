"""NIP-01 / NIP-42 messages between the broker and a relay, sans-IO.

Rules:
- Pure functions and frozen dataclasses: no trio, no sockets, no clock, no logging. The
  I/O lives in `daemon.relay.pool`; everything here can be tested with strings alone.
- Client messages are encoded as compact JSON with ``ensure_ascii=False`` (the relay
  sees the same UTF-8 a Buzz client would send).
- Relay messages are parsed strictly: a frame that is not one JSON array with a known
  verb and exactly the members NIP-01 gives that verb, of the right types, raises
  `RelayProtocolError` with a machine code. Nothing is guessed, nothing is dropped
  silently; the caller decides what a broken relay costs (the pool drops the connection).
- Events inside ``EVENT`` frames are checked to be JSON objects and kept *verbatim*
  (the parsed dict as received). Their id and signature are checked by the read path
  (`custody.verify_event`), not here: this layer does not trust or distrust content.
- `machine_prefix` reads the NIP-01 machine-readable prefix of an OK/CLOSED message
  (``duplicate:``, ``auth-required:``, ``restricted:``, ...). An unknown prefix is
  `None`, not an error: relays add their own.
- `quote_reason` is the one cut of a relay's free text (an OK's or CLOSED's message, a
  NOTICE) wherever we keep or show it: printable, at most MAX_REASON_CHARS characters.
  A message may be a whole frame (1 Mi characters); what the relay writes must not
  choose how much of an exception, a log line or an agent's answer it fills.
- `check_relay_url` is the transport rule: ``ws://`` only to a loopback host
  (`buzzwire.loopback`, the one rule), ``wss://`` otherwise.

Theory of operation (NIP-01, NIP-42):
    client → relay: ["EVENT", ev] | ["REQ", subid, filter...] | ["CLOSE", subid] | ["AUTH", ev]
    relay → client: ["EVENT", subid, ev] | ["OK", id, bool, msg] | ["EOSE", subid]
                    | ["CLOSED", subid, msg] | ["NOTICE", msg] | ["AUTH", challenge]

WARNING: `_READERS` and the `RelayMessage` union must list the same verbs.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NoReturn, Union
from urllib.parse import urlsplit

from buzzwire import kinds
from buzzwire.loopback import is_loopback_host
from buzzwire.nostr import SignedEvent

__all__ = [
    "AUTH_KIND",
    "MAX_SUBSCRIPTION_ID_CHARS",
    "AuthChallenge",
    "Closed",
    "EndOfStoredEvents",
    "EventMessage",
    "Notice",
    "Ok",
    "Prefix",
    "RelayMessage",
    "RelayProtocolError",
    "RelayUrl",
    "check_relay_url",
    "encode_auth",
    "encode_close",
    "encode_event",
    "encode_req",
    "machine_prefix",
    "MAX_REASON_CHARS",
    "quote_reason",
    "parse_relay_message",
    "split_event_frame",
    "subscription_id",
]

#: NIP-42: the kind of the client's authentication event.
AUTH_KIND = kinds.AUTH
#: NIP-01: "subscription_id is an arbitrary, non-empty string of max length 64 chars".
MAX_SUBSCRIPTION_ID_CHARS = 64

_HEX64 = re.compile(r"[0-9a-f]{64}")


class RelayProtocolError(Exception):
    """Remote error: the relay sent something NIP-01 does not allow.

    ``code`` is a stable machine word (`not_json`, `not_array`, `unknown_verb`,
    `bad_arity`, `bad_member`); ``detail`` is operator text and may quote the relay.
    """

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail


class Prefix(enum.Enum):
    """NIP-01 machine-readable prefixes of OK and CLOSED messages (value = wire word)."""

    #: the relay already has this event (with OK true: a retry of identical bytes is safe)
    DUPLICATE = "duplicate"
    #: proof of work is insufficient
    POW = "pow"
    #: the pubkey or network is blocked
    BLOCKED = "blocked"
    #: too many requests
    RATE_LIMITED = "rate-limited"
    #: the event or request is malformed
    INVALID = "invalid"
    #: the client must authenticate (NIP-42) and then resend
    AUTH_REQUIRED = "auth-required"
    #: authenticated, but this pubkey may not do this
    RESTRICTED = "restricted"
    #: the relay's own failure
    ERROR = "error"
    #: the relay is muting this pubkey
    MUTE = "mute"


_PREFIXES: Mapping[str, Prefix] = {p.value: p for p in Prefix}

#: Longest relay text (an OK's or CLOSED's message, a NOTICE) kept in an exception or a
#: result, written to the operator log, or quoted back to an agent: the same cut for all
#: (past it a hostile relay would choose how much of each it fills). 200 characters hold
#: every reason Buzz's relay and the NIP-01 examples give, prefix and all.
MAX_REASON_CHARS = 200
#: Characters of relay text `quote_reason` reads: room for leading blanks and controls
#: before the MAX_REASON_CHARS it keeps, and no more (a character-by-character pass over a
#: whole 1 Mi-character message would cost ~0.1 s of the event loop per message).
_QUOTE_SCAN = 4 * MAX_REASON_CHARS


def machine_prefix(message: str) -> Prefix | None:
    """The NIP-01 prefix of an OK/CLOSED message, or None when there is none we know."""
    word, sep, _ = message.partition(":")
    if not sep:
        return None
    return _PREFIXES.get(word.strip())


def quote_reason(reason: str) -> str:
    """`reason`, relay text, as we keep and show it: of its first _QUOTE_SCAN characters,
    each one `str.isprintable` refuses (controls, line and paragraph separators, bidi
    controls) becomes a space, the ends are stripped, and the rest is cut at
    MAX_REASON_CHARS; "no reason given" when nothing is left. A prefix at the message's
    start (`machine_prefix`) stays the quote's; one a relay puts behind controls or past the
    scan may read differently, which changes only how its own messages are grouped in the
    log (channel_read `_relay_cause`), never what an agent is answered."""
    printable = "".join(ch if ch.isprintable() else " " for ch in reason[:_QUOTE_SCAN]).strip()
    return printable[:MAX_REASON_CHARS] or "no reason given"


# --- relay → client ---------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class EventMessage:
    """["EVENT", subscription_id, event]: one stored or live event, kept verbatim."""

    subscription_id: str
    event: dict[str, object]


@dataclass(frozen=True, slots=True, kw_only=True)
class Ok:
    """["OK", event_id, accepted, message]: the relay's verdict on one EVENT or AUTH."""

    event_id: str
    accepted: bool
    message: str

    @property
    def prefix(self) -> Prefix | None:
        return machine_prefix(self.message)


@dataclass(frozen=True, slots=True, kw_only=True)
class EndOfStoredEvents:
    """["EOSE", subscription_id]: every stored event matching the REQ has been sent."""

    subscription_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Closed:
    """["CLOSED", subscription_id, message]: the relay ended the subscription itself."""

    subscription_id: str
    message: str

    @property
    def prefix(self) -> Prefix | None:
        return machine_prefix(self.message)


@dataclass(frozen=True, slots=True, kw_only=True)
class Notice:
    """["NOTICE", message]: human-readable, for the operator log only."""

    message: str


@dataclass(frozen=True, slots=True, kw_only=True)
class AuthChallenge:
    """["AUTH", challenge]: NIP-42; answer with a signed kind-22242 event."""

    challenge: str


RelayMessage = Union[EventMessage, Ok, EndOfStoredEvents, Closed, Notice, AuthChallenge]


def _str(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise RelayProtocolError("bad_member", f"{what} is not a string")
    return value


def _subid(value: object) -> str:
    s = _str(value, "subscription id")
    if not s or len(s) > MAX_SUBSCRIPTION_ID_CHARS:
        raise RelayProtocolError("bad_member", "subscription id is empty or too long")
    return s


def _read_event(items: list[object]) -> RelayMessage:
    event = items[2]
    if not isinstance(event, dict):
        raise RelayProtocolError("bad_member", "EVENT payload is not an object")
    return EventMessage(subscription_id=_subid(items[1]), event=event)


def _read_ok(items: list[object]) -> RelayMessage:
    event_id = _str(items[1], "OK event id")
    if not _HEX64.fullmatch(event_id):
        raise RelayProtocolError("bad_member", "OK event id is not 64 lowercase hex")
    # bool is checked by identity: JSON 1/0 are not true/false.
    if not isinstance(items[2], bool):
        raise RelayProtocolError("bad_member", "OK status is not a boolean")
    return Ok(event_id=event_id, accepted=items[2], message=_str(items[3], "OK message"))


def _read_eose(items: list[object]) -> RelayMessage:
    return EndOfStoredEvents(subscription_id=_subid(items[1]))


def _read_closed(items: list[object]) -> RelayMessage:
    return Closed(subscription_id=_subid(items[1]), message=_str(items[2], "CLOSED message"))


def _read_notice(items: list[object]) -> RelayMessage:
    return Notice(message=_str(items[1], "NOTICE message"))


def _read_auth(items: list[object]) -> RelayMessage:
    challenge = _str(items[1], "AUTH challenge")
    if not challenge:
        raise RelayProtocolError("bad_member", "AUTH challenge is empty")
    return AuthChallenge(challenge=challenge)


#: verb → (number of array items including the verb, reader).
_READERS: Mapping[str, tuple[int, Callable[[list[object]], RelayMessage]]] = {
    "EVENT": (3, _read_event),
    "OK": (4, _read_ok),
    "EOSE": (2, _read_eose),
    "CLOSED": (3, _read_closed),
    "NOTICE": (2, _read_notice),
    "AUTH": (2, _read_auth),
}


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    # A duplicate key makes an event's meaning depend on the parser; refuse it.
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise RelayProtocolError("not_json", f"duplicate key {key!r}")
        out[key] = value
    return out


def _no_constants(name: str) -> NoReturn:
    raise RelayProtocolError("not_json", f"{name} is not JSON")


#: The start of an EVENT frame whose subscription id JSON reads as its own characters
#: (printable ASCII without a quote or a backslash, 1-64 of them), as every id this
#: client sends is (`subscription_id`). What follows is the event and the closing bracket.
_EVENT_FRAME = re.compile(r'\["EVENT","([ !#-\[\]-~]{1,64})",')


def split_event_frame(frame: str) -> tuple[str, str] | None:
    """An EVENT frame's subscription id and the text after it, or None.

    Why: a fleet's agents receive the same event on their own connections, one frame
    each, differing only in the subscription id. The JSON reader's state after
    ``["EVENT","<id>",`` is the same whatever such an id, so `parse_relay_message` of
    the frame is ``EVENT``, that id, and whatever the rest reads as: a frame whose rest
    is exactly one already parsed (and found a 3-item EVENT with an object) parses to
    an equal event. Only a frame that starts this way, byte for byte, is split.
    """
    match = _EVENT_FRAME.match(frame)
    if match is None:
        return None
    return match.group(1), frame[match.end():]


def parse_relay_message(text: str | bytes) -> RelayMessage:
    """Parse one WebSocket frame from the relay.

    Args:
        text: the frame's payload (text frames are str; bytes are decoded as UTF-8).

    Returns:
        One of the `RelayMessage` dataclasses.

    Raises:
        RelayProtocolError: anything NIP-01 does not allow (remote input; never a bug).
    """
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise RelayProtocolError("not_json", "frame is not UTF-8") from None
    try:
        items = json.loads(
            text, object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constants
        )
    except (ValueError, RecursionError):
        raise RelayProtocolError("not_json", "frame is not JSON") from None
    if not isinstance(items, list) or not items:
        raise RelayProtocolError("not_array", "frame is not a non-empty JSON array")
    verb = items[0]
    entry = _READERS.get(verb) if isinstance(verb, str) else None
    if entry is None:
        raise RelayProtocolError("unknown_verb", f"unknown verb {str(verb)[:32]!r}")
    arity, reader = entry
    if len(items) != arity:
        raise RelayProtocolError("bad_arity", f"{verb} has {len(items)} items, expected {arity}")
    return reader(items)


# --- client → relay ---------------------------------------------------------------


def _dumps(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def encode_event(event: SignedEvent) -> str:
    """["EVENT", event] — the same event always encodes to the same bytes (a retry)."""
    return _dumps(["EVENT", event.to_json_obj()])


def encode_auth(event: SignedEvent) -> str:
    """["AUTH", event] — NIP-42: the signed kind-22242 answer to a challenge."""
    if event.kind != AUTH_KIND:
        raise ValueError(f"an AUTH event must be kind {AUTH_KIND}")
    return _dumps(["AUTH", event.to_json_obj()])


def encode_req(sub_id: str, filters: Sequence[Mapping[str, object]]) -> str:
    """["REQ", sub_id, filter...]; NIP-01 needs at least one filter."""
    if not filters:
        raise ValueError("a REQ needs at least one filter")
    if not sub_id or len(sub_id) > MAX_SUBSCRIPTION_ID_CHARS:
        raise ValueError("subscription id must be 1..64 characters")
    return _dumps(["REQ", sub_id, *[dict(f) for f in filters]])


def encode_close(sub_id: str) -> str:
    """["CLOSE", sub_id]."""
    return _dumps(["CLOSE", sub_id])


def subscription_id(counter: int) -> str:
    """The subscription id for the `counter`-th REQ on a connection (unique per connection)."""
    if counter < 0:
        raise ValueError("counter must be >= 0")
    return f"q{counter}"


# --- the transport rule -----------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RelayUrl:
    """A relay URL that passed `check_relay_url`. ``text`` is the URL exactly as written
    (NIP-42: the AUTH event's relay tag must equal the relay's own URL, byte for byte)."""

    text: str
    secure: bool
    host: str
    port: int
    #: the HTTP Host header: the URL's authority as written (host[:port]).
    host_header: str
    resource: str


_DEFAULT_PORTS = {"ws": 80, "wss": 443}




def check_relay_url(url: str) -> RelayUrl:
    """Validate a relay URL: ``wss://`` anywhere, ``ws://`` only to a loopback host.

    Raises:
        ValueError: with a message naming the rule broken (configuration error: local).
    """
    if not isinstance(url, str) or not url or url != url.strip():
        raise ValueError("relay url must be a non-empty string without surrounding spaces")
    parts = urlsplit(url)
    if parts.scheme not in _DEFAULT_PORTS:
        raise ValueError("relay url must start with ws:// or wss://")
    if parts.username is not None or parts.password is not None or parts.fragment:
        raise ValueError("relay url must not carry credentials or a fragment")
    host = parts.hostname
    if not host:
        raise ValueError("relay url has no host")
    try:
        port = parts.port or _DEFAULT_PORTS[parts.scheme]
    except ValueError:
        raise ValueError("relay url has an invalid port") from None
    secure = parts.scheme == "wss"
    if not secure and not is_loopback_host(host):
        # Plain ws:// would expose AUTH events and every message to the network.
        raise ValueError("ws:// is allowed only to a loopback host; use wss://")
    resource = parts.path or "/"
    if parts.query:
        resource += "?" + parts.query
    return RelayUrl(
        text=url, secure=secure, host=host, port=port, host_header=parts.netloc, resource=resource
    )
