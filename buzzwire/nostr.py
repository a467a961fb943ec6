"""Public Nostr data: event values, NIP-01 serialization and id, verification, NIP-OA checks.

Rules:
- Nothing here touches a secret: it is the half of the signer that anyone may run. Custody,
  the daemon's read path and the agent-side client all import it from here.
- The id is NIP-01's: sha256 of the UTF-8 bytes of
  `json.dumps([0, pubkey, created_at, kind, tags, content], separators=(",", ":"),
  ensure_ascii=False)`. `ensure_ascii=False` matters: Python's default escapes every
  non-ASCII character and the id would differ from every other implementation's.
  (buzz-on-the-relay.md, first section.)
- Event values validate in construction: an `UnsignedEvent` that exists is well-formed.
- `SignedEvent` is the one event type from builder to custody to relay to ledger record:
  `SignedEvent.from_json_obj` is the only way in from JSON (a relay's answer, a ledger
  record), and it checks shape only; `verify_signed` checks id and signature.
- NIP-OA owner tag: `["auth", owner, conditions, sig]`, sig = the owner's BIP-340 signature
  over sha256(utf8("nostr:agent-auth:" + agent_pubkey_hex + ":" + conditions)).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from coincurve import PublicKeyXOnly

from buzzwire import kinds

__all__ = [
    "UnsignedEvent",
    "SignedEvent",
    "serialize_event",
    "compute_event_id",
    "verify_event",
    "verify_signed",
    "owner_tag_digest",
    "verify_owner_tag",
    "is_hex64",
    "require_pubkey",
]

_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX128 = re.compile(r"[0-9a-f]{128}")
#: A NIP-OA clause, its decimal canonical (no sign, no leading zero), and each name's most.
_CLAUSE = re.compile(r"(kind=|created_at<|created_at>)(0|[1-9][0-9]{0,9})")
_CLAUSE_MAX = {"kind=": 65535, "created_at<": 2**32 - 1, "created_at>": 2**32 - 1}
MAX_KIND = kinds.MAX
OWNER_TAG_PREFIX = "nostr:agent-auth:"

Tags = tuple[tuple[str, ...], ...]


def is_hex64(value: object) -> bool:
    """Lowercase 64-hex: the only spelling of a pubkey or event id custody accepts."""
    return isinstance(value, str) and _HEX64.fullmatch(value) is not None


def require_pubkey(name: str, value: object) -> None:
    """ValueError naming `name` unless `value` is `is_hex64`."""
    if not is_hex64(value):
        raise ValueError(f"{name} must be 64 lowercase hex characters")


def _freeze_tags(tags: Iterable[Iterable[str]]) -> Tags:
    if isinstance(tags, (str, bytes)):
        raise TypeError("tags must be a sequence of sequences of str")
    frozen = []
    for tag in tags:
        if isinstance(tag, (str, bytes)):
            raise TypeError("each tag must be a sequence of str")
        items = tuple(tag)
        if not all(isinstance(item, str) for item in items):
            raise TypeError("tag items must be str")
        frozen.append(items)
    return tuple(frozen)


def _tags_of(value: object) -> Tags:
    """JSON tags (an array of arrays of strings) as `Tags`; TypeError for anything else."""
    if not isinstance(value, (list, tuple)):
        raise TypeError("tags must be an array")
    tags = []
    for tag in value:
        if not isinstance(tag, (list, tuple)) or not all(isinstance(i, str) for i in tag):
            raise TypeError("each tag must be an array of strings")
        tags.append(tuple(str(i) for i in tag))
    return tuple(tags)


def _check_common(pubkey: object, created_at: object, kind: object, content: object) -> None:
    require_pubkey("pubkey", pubkey)
    if not isinstance(created_at, int) or isinstance(created_at, bool) or created_at < 0:
        raise ValueError("created_at must be a non-negative int")
    if not isinstance(kind, int) or isinstance(kind, bool) or not 0 <= kind <= MAX_KIND:
        raise ValueError(f"kind must be an int in 0..{MAX_KIND}")
    if not isinstance(content, str):
        raise TypeError("content must be str")


@dataclass(frozen=True, slots=True)
class UnsignedEvent:
    """An event to sign. `tags` may be given as any sequence of sequences of str; it is frozen."""

    pubkey: str
    created_at: int
    kind: int
    tags: Tags
    content: str

    def __post_init__(self) -> None:
        _check_common(self.pubkey, self.created_at, self.kind, self.content)
        object.__setattr__(self, "tags", _freeze_tags(self.tags))


@dataclass(frozen=True, slots=True)
class SignedEvent:
    """A signed NIP-01 event. Public: nothing in it is secret."""

    id: str
    pubkey: str
    created_at: int
    kind: int
    tags: Tags
    content: str
    sig: str

    def __post_init__(self) -> None:
        _check_common(self.pubkey, self.created_at, self.kind, self.content)
        object.__setattr__(self, "tags", _freeze_tags(self.tags))
        if not is_hex64(self.id) or not isinstance(self.sig, str) or not _HEX128.fullmatch(self.sig):
            raise ValueError("id must be 64 and sig 128 lowercase hex characters")

    @classmethod
    def from_json_obj(cls, obj: Mapping[str, object]) -> SignedEvent:
        """The event a NIP-01 JSON object spells (its seven members; others are ignored).

        Checks the shape only (members, types, hex forms), not the id or signature: see
        `verify_signed`. Raises ValueError for anything else, whatever is wrong.
        """
        try:
            id_, pubkey, created_at, kind, content, sig = (
                obj["id"], obj["pubkey"], obj["created_at"], obj["kind"], obj["content"],
                obj["sig"])
            tags = _tags_of(obj["tags"])
        except (KeyError, TypeError):
            raise ValueError("not a NIP-01 event object") from None
        if not (isinstance(id_, str) and isinstance(pubkey, str) and isinstance(sig, str)
                and isinstance(created_at, int) and isinstance(kind, int)
                and isinstance(content, str)):
            raise ValueError("not a NIP-01 event object")
        return cls(id=id_, pubkey=pubkey, created_at=created_at, kind=kind, tags=tags,
                   content=content, sig=sig)

    def tag_value(self, name: str) -> str | None:
        """The first value of the first tag called `name`, if any."""
        for tag in self.tags:
            if len(tag) >= 2 and tag[0] == name:
                return tag[1]
        return None

    def to_json_obj(self) -> dict[str, object]:
        """The seven NIP-01 members, tags as lists (ready for json.dumps)."""
        return {
            "id": self.id,
            "pubkey": self.pubkey,
            "created_at": self.created_at,
            "kind": self.kind,
            "tags": [list(tag) for tag in self.tags],
            "content": self.content,
            "sig": self.sig,
        }


def serialize_event(
    pubkey: str, created_at: int, kind: int, tags: Iterable[Iterable[str]], content: str
) -> bytes:
    """NIP-01 canonical bytes whose sha256 is the event id."""
    array = [0, pubkey, created_at, kind, [list(tag) for tag in tags], content]
    return json.dumps(array, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def compute_event_id(
    pubkey: str, created_at: int, kind: int, tags: Iterable[Iterable[str]], content: str
) -> str:
    """NIP-01 event id (lowercase hex)."""
    return hashlib.sha256(serialize_event(pubkey, created_at, kind, tags, content)).hexdigest()


def _schnorr_verify(pubkey_hex: str, sig_hex: str, message32: bytes) -> bool:
    try:
        return bool(PublicKeyXOnly(bytes.fromhex(pubkey_hex)).verify(bytes.fromhex(sig_hex), message32))
    except (ValueError, TypeError):
        return False  # not a curve point, or malformed: not a valid signature


def verify_event(obj: Mapping[str, object]) -> bool:
    """True iff `obj` is a well-formed NIP-01 event whose id and BIP-340 signature are right.

    Public data only. Never raises for bad input: anything malformed is simply False.
    """
    try:
        event = SignedEvent.from_json_obj(obj)
    except (ValueError, TypeError):
        return False
    return verify_signed(event)


def verify_signed(event: SignedEvent) -> bool:
    """True iff the event's id is its NIP-01 id and its BIP-340 signature is valid."""
    try:
        expected = compute_event_id(event.pubkey, event.created_at, event.kind, event.tags,
                                    event.content)
    except UnicodeEncodeError:
        # A lone surrogate (JSON can spell one, `"\ud800"`) has no UTF-8 form, so the event
        # has no NIP-01 id: it fails the check, as any other malformed event does.
        return False
    if expected != event.id:
        return False
    return _schnorr_verify(event.pubkey, event.sig, bytes.fromhex(event.id))


def owner_tag_digest(agent_pubkey: str, conditions: str) -> bytes:
    """NIP-OA: sha256(utf8("nostr:agent-auth:" + agent_pubkey_hex + ":" + conditions))."""
    require_pubkey("agent_pubkey", agent_pubkey)
    return hashlib.sha256(f"{OWNER_TAG_PREFIX}{agent_pubkey}:{conditions}".encode()).digest()


def verify_owner_tag(tag: Iterable[str], agent_pubkey: str) -> bool:
    """True iff `tag` is `["auth", owner, conditions, sig]` with a valid owner signature for
    `agent_pubkey`, owner != agent, and conditions `""` or `&`-joined clauses (NIP-OA).
    Whether an event meets the clauses is its caller's check."""
    items = tuple(tag)
    if len(items) != 4 or not all(isinstance(item, str) for item in items) or items[0] != "auth":
        return False
    _, owner, conditions, sig = items
    if not is_hex64(owner) or not _HEX128.fullmatch(sig) or owner == agent_pubkey:
        return False
    clauses = [_CLAUSE.fullmatch(c) for c in conditions.split("&")] if conditions else []
    if not all(m and int(m[2]) <= _CLAUSE_MAX[m[1]] for m in clauses):
        return False
    return _schnorr_verify(owner, sig, owner_tag_digest(agent_pubkey, conditions))
