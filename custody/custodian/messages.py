"""The custodian's message table: the closed, versioned set of requests it answers.

Theory of operation (OpenSSH's monitor.c, in our own words): the process that holds the
keys answers a fixed table of requests and nothing else. Each row names an operation and
the exact members of its arguments with their types; a request is one frame:

    u32 big-endian length N, then N bytes of UTF-8 JSON {"v": 4, "op": <name>, "args": {...}}

and its answer one frame `{"v": 4, "ok": <value>}` or `{"v": 4, "error": {"code", "message"}}`.

A row in `TAILS` carries a secret, never in the JSON (a JSON string becomes an immutable
`str` in both processes, which nothing can wipe): its request names a length, and that
many raw bytes follow the frame, which each side keeps in a bytearray it zeroes after use.

Rules:
- Pure: bytes in, values out; no socket, no clock, no logging. The server and the
  pipeline's client (custody/custodian/client.py) both read through `parse` and write
  through `encode`; the request's half is here, the answer's in the client.
- Strict: a length over `MAX_FRAME` or more than `MAX_VALUES` values, bytes that are not
  UTF-8 JSON, a string holding a lone surrogate, a duplicate member, a float, NaN, a
  member not in the row, a missing one or one of the wrong type is one `BadMessage`,
  never anything else (tests/custodian/test_messages_fuzz.py fuzzes this, row by row).
- `VERSION` changes whenever a row changes; a request of another version is refused.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

from buzzwire.jsonvalues import values_at_most
from custody._records import MAX_RECORDS as _MOST_RECORDS, KeyRecord

__all__ = [
    "VERSION", "MAX_FRAME", "MAX_VALUES", "MAX_EVENTS", "MAX_PAYLOADS", "MAX_SECRET_BYTES", "MAX_BACKUP_NAMES",
    "OPS", "TAILS", "LOOKUPS",
    "ERROR_CODES", "HEADER",
    "BadMessage", "OtherVersion", "Request", "encode", "parse", "frame_length", "decode_request",
    "reply_ok", "reply_error", "b64", "record_obj",
    "MAX_RECORDS",
]

#: The table's version: bumped with any row (2: import's secret left the JSON; backup;
#: 3: relay; 4: token).
VERSION: Final = 4
#: Bytes in one frame at most. The largest request the fifteen actions make is
#: observer.emit's: 256 frames (NIP-BA) of up to 65,535 bytes each, base64 in JSON
#: (4/3): 22.4 MB. The bound is the custodian's, checked before a byte of the body is read.
MAX_FRAME: Final = 24 * 1024 * 1024
#: Events in one `sign` request: the signing batcher's batch (daemon/pipeline/signing.py).
MAX_EVENTS: Final = 256
#: NIP-44 payloads in one encrypt/decrypt request: custody's own per-call bound.
MAX_PAYLOADS: Final = 256
#: Tags on one event, values in one tag, characters in a tag value or content.
MAX_TAGS: Final = 64
MAX_TAG_VALUES: Final = 8
MAX_CONTENT: Final = 1024 * 1024
HEADER: Final = struct.Struct(">I")
#: Bytes of secret text one import carries at most: custody's own bound on secret text
#: (custody._files.MAX_SECRET_TEXT; tests/custodian/test_messages.py holds them equal).
MAX_SECRET_BYTES: Final = 256

#: Codes an error answer carries; the client maps each to one exception.
ERROR_CODES: Final = frozenset({
    "bad_message",    # the frame broke the table: the connection is closed after it
    "unknown_agent",  # no live agent with that key
    "unseal_failed",  # the sealed key did not open as that agent
    "custody",        # a custody fault (token, keystore, owner that is no curve point),
                      # or the backup directory full (its disk, or [backup] max_files)
    "invalid",        # the caller's bug: a value custody refuses (a bad slug, a bad owner)
    "refused",        # an intent outside the closed list of kinds and shapes, or a pair
                      # other than agent-owner, or AUTH for another relay
    "rate_limited",   # the agent's signing bound is used up, or the backup row asked
                      # again within [backup] min_interval_seconds
    "internal",       # the custodian's own fault (logged there, never detailed here)
})


class BadMessage(Exception):
    """A frame that breaks the table. The message names the rule, never a value."""


class OtherVersion(BadMessage):
    """A message of another table version, `version` (an integer, as every build's `v`):
    a peer of another build, such as a custodian not restarted after an upgrade."""

    def __init__(self, version: int) -> None:
        super().__init__(f"a version {version} message, not {VERSION}")
        self.version = version


Spec = Callable[[object], object]

_HEX64 = re.compile(r"[0-9a-f]{64}")


def _hex64(value: object) -> object:
    if not isinstance(value, str) or not _HEX64.fullmatch(value):
        raise BadMessage("expected 64 lowercase hex characters")
    return value




def _str(limit: int) -> Spec:
    def check(value: object) -> object:
        if not isinstance(value, str) or len(value) > limit:
            raise BadMessage(f"expected a string of at most {limit} characters")
        return value
    return check


def _int(low: int, high: int) -> Spec:
    def check(value: object) -> object:
        # bool is an int in Python, never in this table
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise BadMessage(f"expected an integer in {low}..{high}")
        return value
    return check


def _bool(value: object) -> object:
    if not isinstance(value, bool):
        raise BadMessage("expected true or false")
    return value


def _nullable(inner: Spec) -> Spec:
    def check(value: object) -> object:
        return None if value is None else inner(value)
    return check


def _list(inner: Spec, low: int, high: int) -> Spec:
    def check(value: object) -> object:
        if not isinstance(value, list) or not low <= len(value) <= high:
            raise BadMessage(f"expected a list of {low}..{high} items")
        return tuple(inner(item) for item in value)
    return check


def _object(members: Mapping[str, Spec]) -> Spec:
    def check(value: object) -> object:
        if not isinstance(value, dict) or value.keys() != members.keys():
            raise BadMessage("expected an object with exactly the members " + ",".join(members))
        return {name: spec(value[name]) for name, spec in members.items()}
    return check


_B64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")


def _b64(value: object) -> object:
    if not isinstance(value, str) or not _B64.fullmatch(value):
        raise BadMessage("expected base64")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise BadMessage("expected base64") from None


_TIME = _int(0, 2**40)
_TAG = _list(_str(MAX_CONTENT), 1, MAX_TAG_VALUES)
_AUTH_TAG = _list(_str(1024), 4, 4)
#: One event intent: what the custodian builds the event from. `signer` is the key that
#: signs; the custodian adds the NIP-OA tag itself and checks kind and shape (intents.py).
_INTENT = _object({
    "signer": _hex64, "kind": _int(0, 65535), "created_at": _TIME,
    "tags": _list(_TAG, 0, MAX_TAGS), "content": _str(MAX_CONTENT),
})

#: Agents one `backup` request names (their directory entries, at most ~350 bytes each:
#: inside MAX_FRAME).
MAX_BACKUP_NAMES: Final = 65536
_NAME = _object({"pubkey": _hex64, "name": _str(256), "creator": _nullable(_hex64)})

#: The table: operation -> its argument members. Closed: an op not here is a BadMessage.
OPS: Final[Mapping[str, Mapping[str, Spec]]] = MappingProxyType({
    # record lookups (no token hop)
    "records_version": {},
    "agent": {"pubkey": _hex64, "include_deleted": _bool},
    "agents": {"include_deleted": _bool},
    "chain": {"pubkey": _hex64},
    # the relay AUTH is signed for: the daemon refuses to start against another
    "relay": {},
    # does its token work now? (a token hop, at most one a second: server.py)
    "token": {},
    # lifecycle
    "mint": {"owner": _hex64, "mint_ref": _nullable(_str(512))},
    # the secret text (64 hex digits or nsec1...) follows the frame: `secret_bytes` bytes
    "import": {"secret_bytes": _int(1, MAX_SECRET_BYTES), "owner": _hex64,
               "auth_tag": _nullable(_AUTH_TAG)},
    "destroy": {"pubkey": _hex64},
    "attach_auth": {"pubkey": _hex64, "tag": _AUTH_TAG},
    # signing intents; 22242 only through sign_auth
    "sign": {"events": _list(_INTENT, 1, MAX_EVENTS)},
    "sign_auth": {"agent": _hex64, "relay_url": _str(2048), "challenge": _str(1024),
                  "created_at": _TIME},
    # NIP-AE and NIP-44, agent <-> its recorded owner only
    "memory_address": {"agent": _hex64, "slug": _str(1024)},
    "encrypt": {"agent": _hex64, "peer": _hex64,
                "plaintexts": _list(_b64, 0, MAX_PAYLOADS)},
    "decrypt": {"agent": _hex64, "peer": _hex64,
                "payloads": _list(_str(200_000), 0, MAX_PAYLOADS)},
    # every live agent, encrypted to the custodian's configured recipients, into a new
    # file of its configured directory: neither is a member. `names`: the directory's
    # public entries the backup carries (name, creator), as `keys backup` gives them.
    "backup": {"names": _list(_NAME, 0, MAX_BACKUP_NAMES)},
})
#: Rows that change nothing and sign nothing: answered while the custodian owes a log
#: line (server.py), and asked again on a fresh connection when one breaks (client.py).
LOOKUPS: Final = frozenset({"records_version", "agent", "agents", "chain", "relay",
                            "token", "memory_address"})


#: op -> the member naming how many raw bytes follow its request frame (a secret).
TAILS: Final[Mapping[str, str]] = MappingProxyType({"import": "secret_bytes"})


@dataclass(frozen=True, slots=True)
class Request:
    """A request that fits its row: `args` hold the checked (and decoded) values."""

    op: str
    args: Mapping[str, object]


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise BadMessage("duplicate member")
    return result


def _no_constant(name: str) -> object:
    raise BadMessage("NaN and Infinity are not JSON")


def _no_float(text: str) -> object:
    raise BadMessage("no floats in the table")


def _int_literal(text: str) -> int:
    # Every number of the table fits 64 bits (20 characters with a sign). Longer is named
    # here: int() past 4,300 digits raises a ValueError, which would read as "not JSON".
    if len(text) > 20:
        raise BadMessage("a number past 64 bits")
    return int(text)


#: Values and member names in one frame at most, counted before it is parsed: a parsed
#: value costs up to ~72 bytes (an empty object, 3 bytes of frame: one frame of them took
#: 600 MiB). The largest request, a backup of MAX_BACKUP_NAMES names, has 7 a name.
MAX_VALUES: Final = 8 * MAX_BACKUP_NAMES


#: A surrogate on its own: JSON can spell one ("\ud800"), but it is no text and has no
#: UTF-8 form, so the event id, the signed log or the daemon's write of an answer to an
#: agent would fail on it later. Only an escape spells one (UTF-8 has none): a frame
#: without one is not walked. One rule for requests and answers, whose `ok` no row types.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _text_only(value: object) -> None:
    items = [value]
    while items:
        item = items.pop()
        if isinstance(item, dict):
            items += [*item, *item.values()]
        elif isinstance(item, list):
            items += item
        elif isinstance(item, str) and _LONE_SURROGATE.search(item):
            raise BadMessage("a string holds a lone surrogate, which is no text")


def parse(body: bytes | bytearray) -> dict[str, object]:
    """A frame body as a message of this version, by every rule above: the one reader of
    requests and answers alike."""
    if len(body) > MAX_FRAME:
        raise BadMessage("frame over the bound")
    if values_at_most(body, MAX_VALUES, MAX_VALUES) > MAX_VALUES:
        raise BadMessage(f"more than {MAX_VALUES} values in one frame")
    try:
        value = json.loads(body.decode("utf-8"), object_pairs_hook=_no_duplicates,
                           parse_constant=_no_constant, parse_float=_no_float,
                           parse_int=_int_literal)
    except BadMessage:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise BadMessage("not UTF-8 JSON") from None
    version = value.get("v") if isinstance(value, dict) else None
    if type(version) is int and version != VERSION:  # type(): a bool is no version
        raise OtherVersion(version)
    if not isinstance(value, dict) or version != VERSION or isinstance(version, bool):
        raise BadMessage(f"not a version {VERSION} message")
    if _SURROGATE_ESCAPE.search(body):
        _text_only(value)
    return value


def frame_length(header: bytes | bytearray) -> int:
    """The body length a 4-byte header announces; BadMessage over `MAX_FRAME`."""
    if len(header) != HEADER.size:
        raise BadMessage("short header")
    (length,) = HEADER.unpack(header)
    if length > MAX_FRAME:
        raise BadMessage("frame over the bound")
    return int(length)


def decode_request(body: bytes | bytearray) -> Request:
    """The request a frame body spells, checked against its row."""
    value = parse(body)
    op, args = value.get("op"), value.get("args")
    if value.keys() != {"v", "op", "args"} or not isinstance(op, str) or op not in OPS:
        raise BadMessage("not a request of the table")
    return Request(op, _object(OPS[op])(args))  # type: ignore[arg-type]


def encode(value: Mapping[str, object]) -> bytes:
    """One frame: header and compact JSON."""
    body = json.dumps(value, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")
    if len(body) > MAX_FRAME:
        raise BadMessage("frame over the bound")
    return HEADER.pack(len(body)) + body


def reply_ok(value: object) -> bytes:
    return encode({"v": VERSION, "ok": value})


def reply_error(code: str, message: str) -> bytes:
    if code not in ERROR_CODES:
        raise AssertionError(f"unknown error code {code}")  # pragma: no cover - our bug
    return encode({"v": VERSION, "error": {"code": code, "message": message}})


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def record_obj(record: KeyRecord | None) -> dict[str, object] | None:
    """A key record as the record rows answer it (`agent`, `agents`, `chain`, `mint`...)."""
    if record is None:
        return None
    return {"pubkey": record.pubkey, "owner": record.owner,
            "auth_tag": None if record.auth_tag is None else list(record.auth_tag),
            "created_at": record.created_at, "deleted_at": record.deleted_at,
            "mint_ref": record.mint_ref}


#: The most records a `max_records` may allow ([custodian]'s, and [custody]'s in the
#: daemon, whose keystore a custodian may serve later), custody's one number
#: (custody/_records.py): that many of the largest still fit the `agents` answer's one
#: frame, and a few more would not
#: (tests/custodian/test_log_and_rate_bounds.py::test_at_most_max_records_the_largest_records_fit_the_agents_answer).
MAX_RECORDS: Final = _MOST_RECORDS
