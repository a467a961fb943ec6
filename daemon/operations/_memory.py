"""NIP-AE records for storage.get and storage.put: the query, head selection, body reading.

Rules (block/buzz NIP-AE, "Head selection", "Bodies", "Writing"):
- Candidates are read from the relay with `kinds [30174]`, `authors [agent]`, `#d [d]`,
  `#p [owner]`; `fetch` has already dropped every event whose id or signature fails, so
  signatures are verified before anything is decrypted (NIP-44's order).
- An event is valid when: kind 30174, pubkey the agent, exactly one `d` tag and it is
  this slug's d, exactly one `p` tag and it is the owner (rule 1); it decrypts under the
  agent↔owner key to UTF-8 JSON that is one object with no duplicate member name at any
  depth (rule 3); the body's `slug` is the slug asked for, which is "re-derives to d"
  (d = HMAC(K_c, slug) was derived from the slug asked for: another slug giving the same d
  is an HMAC-SHA256 collision) (rule 4); its shape matches the slug (rule 5): `core`
  needs a string `profile`, a `mem/…` slug a `value` that is a string or null (a
  tombstone). Unknown members are ignored; this is not the wire's closed-object reader.
- The head is the valid event with the greatest created_at, the lowest id on ties.
- At most MAX_CANDIDATES events are decrypted per read (the relay's `limit`, and the
  newest first if it sent more), in one custody call: a relay cannot make the host
  decrypt without bound.
- Writing: created_at = max(now, T + 1) where T is the newest created_at among the
  agent's signed events at this address, valid or not: those a relay files there (kind,
  author, first `d` tag; the query's `#p` returns only those naming the owner). NIP-AE
  names the head's; taking every signed version as well means the write is also newer
  than a malformed version a relay keeps as the addressable event (else that relay would
  keep it over ours). A T
  whose T + 1 (what the put would be dated) is more than CLOCK_POISON_SECONDS ahead of now
  is NIP-AE's clock-poisoned head ("the resulting created_at"): the put is refused
  (`action_failed`), never published into the future.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from buzzwire import kinds
from buzzwire.contract import ErrorCode
from buzzwire.nostr import SignedEvent
from daemon.operations._base import Context, OperationRefused
from daemon.operations._events import fetch, newest

__all__ = [
    "MEMORY_KIND",
    "MAX_CANDIDATES",
    "CLOCK_POISON_SECONDS",
    "Head",
    "Address",
    "address_of",
    "read_head",
    "write_created_at",
]

#: NIP-AE agent engrams.
MEMORY_KIND = kinds.MEMORY
#: Versions of one record decrypted per read. An addressable record has one current
#: version on a replacing relay; archival relays keep a few more. 64 covers any honest
#: relay many times over and bounds what a hostile one can make custody do.
MAX_CANDIDATES = 64
#: How far ahead of the host's clock a put may be dated (its head's created_at + 1) before
#: NIP-AE's clock-poisoned rule refuses it: 15 minutes, what common relays allow for
#: created_at in the future (strfry's and nostr-rs-relay's defaults are of that order).
CLOCK_POISON_SECONDS = 900


@dataclass(frozen=True, slots=True)
class Address:
    """Where one slug's record lives, and who its owner is (custody's record)."""

    slug: str
    agent: str
    owner: str
    d_tag: str


@dataclass(frozen=True, slots=True)
class Head:
    """The current version of a record: its event, and the body's string (None for a
    memory tombstone)."""

    event: SignedEvent
    text: str | None


async def address_of(ctx: Context, slug: str) -> Address:
    """The slug's address for the requesting agent (one custody hop for the d tag)."""
    agent = ctx.principal.agent
    record = ctx.custody.agent(agent)
    if record is None:  # removed after authentication; nothing has happened
        raise OperationRefused(ErrorCode.ACTION_FAILED, "this agent is no longer held here")
    address = await ctx.custody.memory_address(agent, slug)
    return Address(slug=slug, agent=agent, owner=record.owner, d_tag=address.d_tag)


async def read_head(ctx: Context, address: Address) -> tuple[Head | None, list[SignedEvent]]:
    """The head (None: no valid version) and every signed version at the address.

    Raises:
        OperationRefused(action_failed): the relay could not be read (never "absent").
    """
    found = await fetch(ctx, {
        "kinds": [MEMORY_KIND], "authors": [address.agent], "#d": [address.d_tag],
        "#p": [address.owner], "limit": MAX_CANDIDATES,
    })
    at_address = [e for e in found if _filed_at(e, address)]
    # Newest first, lowest id on ties: the first valid one is the head.
    ordered = sorted((e for e in at_address if _envelope_ok(e, address)),
                     key=lambda e: (-e.created_at, e.id))[:MAX_CANDIDATES]
    if not ordered:
        return None, at_address
    plaintexts = await ctx.custody.decrypt_from_owner_pair(
        address.agent, [e.content for e in ordered])
    for event, plaintext in zip(ordered, plaintexts, strict=True):
        body = None if plaintext is None else read_body(plaintext, address.slug)
        if body is not None:
            return Head(event=event, text=body[0]), at_address
    return None, at_address


def write_created_at(now: int, versions: Sequence[SignedEvent]) -> int:
    """NIP-AE's monotonic created_at for a new version, or refused when clock-poisoned."""
    previous = newest(list(versions))
    if previous is not None and previous.created_at + 1 > now + CLOCK_POISON_SECONDS:
        raise OperationRefused(
            ErrorCode.ACTION_FAILED,
            "this record's newest version is dated in the future; it was not overwritten",
            detail=f"clock-poisoned head: created_at {previous.created_at}, now {now}",
        )
    return now if previous is None else max(now, previous.created_at + 1)


def _filed_at(event: SignedEvent, address: Address) -> bool:
    """A version a NIP-01 relay files under this address (kind, author, first `d` tag),
    valid or not: what a write must be newer than."""
    first_d = next((t[1] for t in event.tags if len(t) >= 2 and t[0] == "d"), None)
    return (event.kind == MEMORY_KIND and event.pubkey == address.agent
            and first_d == address.d_tag)


def _envelope_ok(event: SignedEvent, address: Address) -> bool:
    """Rule 1 (the signature, rule 2, was checked by `fetch`)."""
    if event.kind != MEMORY_KIND or event.pubkey != address.agent:
        return False
    d_tags = [t for t in event.tags if t[:1] == ("d",)]
    p_tags = [t for t in event.tags if t[:1] == ("p",)]
    return (len(d_tags) == 1 and len(d_tags[0]) >= 2 and d_tags[0][1] == address.d_tag
            and len(p_tags) == 1 and len(p_tags[0]) >= 2 and p_tags[0][1] == address.owner)


class _Duplicate(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise _Duplicate()
    return obj


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


#: What a JSON integer reads as: never converted, so a member NIP-AE has readers ignore
#: cannot make a valid body invalid by holding more digits than `int()` takes (4,300);
#: and not a str, so an integer `value` stays no string.
_INTEGER = object()


def read_body(plaintext: bytes, slug: str) -> tuple[str | None] | None:
    """Rules 3-5 on a decrypted body: `(text,)` (text None for a tombstone), or None when
    the body makes the event invalid."""
    try:
        obj = json.loads(plaintext.decode("utf-8"), object_pairs_hook=_no_duplicates,
                         parse_constant=_no_constant, parse_int=lambda _digits: _INTEGER)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or obj.get("slug") != slug:
        return None
    member = "profile" if slug == "core" else "value"
    if member not in obj:
        return None
    text = obj[member]
    if text is None and slug != "core":
        return (None,)
    if not isinstance(text, str) or not _utf8(text):
        return None
    return (text,)


def _utf8(text: str) -> bool:
    # "\ud800" parses to a lone surrogate, which is no UTF-8 string (NIP-AE: value is one).
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
