"""Small shared steps for operations that build events: tags, signing, reads, replaceable clocks.

Kept here so each operation module reads as the list of steps the relay spec gives for it.

Rules:
- Operations sign only through `sign` / `sign_all`, which go through the context's
  `SigningBatcher` to custody; nothing here sees a key.
- Operations read the relay only through `fetch`, which reads as the requester and drops
  every event whose id or signature does not verify: an operation never builds on an
  event it could not check (a reply's parent, a profile's or a record's previous version).
- Events are `buzzwire.nostr.SignedEvent` both ways: what custody signs, what a plan
  publishes and what `fetch` hands back (checked, then typed). No event is a dict here.
- A relay that cannot be read is `OperationRefused(action_failed)`: nothing was published
  yet, so `failed` is honest.
- Replaceable events (kind 0, kind 30177) get `next_created_at`: strictly after the version
  they replace (design.md, "Replaceable events in one second").
- Which channel an event is in (`in_channel`) and which thread (`declared_thread`,
  `in_thread`) is read from its signed tags by one rule each in `buzzwire.threads`, for
  what a read delivers, what a reply or a reaction builds on, and what the agent-side
  client's echo check accepts (NIP-BA: "Ancestry and mentions come from signed tags").
- What a reply or a reaction builds on (`fetch_in_channel`: a parent, a thread root, a
  target) is a channel message: one of the kinds channel.read returns (its `READ_KINDS`,
  the one table of them). NIP-BA reuses NIP-10's marked root/reply "for Buzz kind 9";
  any other event carrying the channel's `h` tag (a NIP-29 moderation event, an app
  record) would otherwise root a thread no read of the channel shows.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence

from buzzwire.contract import ErrorCode
from buzzwire.nostr import SignedEvent, UnsignedEvent, verify_signed
from buzzwire.threads import in_channel
from daemon.operations._base import Context, OperationRefused
from daemon.operations.channel_read import READ_KINDS
from daemon.relay.pool import RelayRefused, RelayUnavailable

__all__ = [
    "sign",
    "mention_tags",
    "next_created_at",
    "newest",
    "json_object_or_none",
    "tag_value",
    "fetch",
    "fetch_in_channel",
    "verified",
    "sign_all",
    "check_builds_on_latest",
]

Tag = tuple[str, ...]


async def sign(ctx: Context, author: str, kind: int, tags: Sequence[Tag], content: str,
               created_at: int | None = None) -> SignedEvent:
    """Sign one event as `author` in custody and return its seven-member object.

    It goes through the batcher: under load, concurrent requests share one token hop."""
    unsigned = UnsignedEvent(
        pubkey=author,
        created_at=ctx.now() if created_at is None else created_at,
        kind=kind,
        tags=tuple(tuple(t) for t in tags),
        content=content,
    )
    [signed] = await ctx.signer.sign([(author, unsigned)])
    return signed


def mention_tags(mentions: Sequence[str]) -> list[Tag]:
    """One `p` tag per mentioned pubkey (the contract has lowercased and de-duplicated them)."""
    return [("p", pk) for pk in mentions]


def next_created_at(now: int, previous: SignedEvent | None) -> int:
    """created_at for a new version of a replaceable event.

    Relays keep the lowest id when two versions share a second, not the newest write, so a
    new version must be strictly later than the one it replaces (design.md traps; NIP-AE's
    writer rule).
    """
    if previous is None:
        return now
    return max(now, previous.created_at + 1)


def newest(events: Sequence[SignedEvent]) -> SignedEvent | None:
    """The version a relay would keep: highest created_at, then lowest id."""
    best: SignedEvent | None = None
    for ev in events:
        if best is None or _kept_order(ev.created_at, ev.id) > _kept_order(best.created_at, best.id):
            best = ev
    return best


def _kept_order(created_at: int, event_id: str) -> tuple[int, tuple[int, ...]]:
    """NIP-01's order of a replaceable event's versions, the one a relay keeps last: the
    later created_at, and within one second the lower id."""
    return created_at, tuple(-b for b in bytes.fromhex(event_id))


def json_object_or_none(text: str) -> dict[str, object] | None:
    """The content of a profile or managed-agent record, or None when it is not a JSON object."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # a relay's event may nest deeper than json reads
        return None
    return value if isinstance(value, dict) else None


def tag_value(event: SignedEvent, name: str) -> str | None:
    """The first value of the first tag called `name`, if any."""
    return event.tag_value(name)


def check_builds_on_latest(ctx: Context, author: str, kind: int, d: str,
                           previous: SignedEvent | None) -> None:
    """Refuse to build on a version older than the last one this host published (issue 22 L4).

    The relay decides what "newest" is; a relay that withholds the latest version would
    otherwise have an older one merged and re-signed as new. The version this host last
    published (accepted, or sent with no answer: daemon/state/sign_watermarks.py) is the
    floor: the relay's newest must be it, or one the relay keeps over it by NIP-01's rule
    (`_kept_order`: a later created_at, or the same second and a lower id), another
    client's write. The tie counts: a version of ours that lost a same-second tie (Buzz
    answers it `OK true "duplicate:"`, and the pool records it) or was replaced by one
    is not the relay's newest, and the winner was never withheld; a head it beats is.

    Raises:
      OperationRefused(action_failed): the relay answered nothing, or something older.
    """
    store = ctx.relay.watermarks
    mark = None if store is None else store.get(author, kind, d)
    if mark is None or (previous is not None and _kept_order(previous.created_at, previous.id)
                        >= _kept_order(mark.created_at, mark.event_id)):
        return
    relay_has = "nothing" if previous is None else f"{previous.id} at {previous.created_at}"
    raise OperationRefused(
        ErrorCode.ACTION_FAILED,
        "the relay's newest version is older than the last one this host published",
        detail=f"kind {kind} d {d[:80]!r}: relay has {relay_has}, "
               f"published here {mark.event_id} at {mark.created_at}",
    )


async def fetch(ctx: Context, query_filter: Mapping[str, object]) -> list[SignedEvent]:
    """Read events as the requester; events whose id or signature fail are dropped.

    Raises:
      OperationRefused(action_failed): the relay could not be read. Nothing was published
        yet, so `failed` is honest.
    """
    try:
        events = await ctx.relay.query(ctx.principal.agent, [dict(query_filter)])
    except (RelayUnavailable, RelayRefused) as exc:
        # The reason, not repr(exc): it is bounded where the pool took the relay's text
        # (`quote_reason`), and repr would escape it again, longer.
        raise OperationRefused(
            ErrorCode.ACTION_FAILED, "the relay could not be read",
            detail=f"{type(exc).__name__}: {exc.reason}"
        ) from None
    return verified(events)


def verified(events: Iterable[Mapping[str, object]]) -> list[SignedEvent]:
    """The events, as read from a relay, whose shape, id and signature check out."""
    checked = []
    for raw in events:
        try:
            event = SignedEvent.from_json_obj(raw)
        except ValueError:
            continue
        if verify_signed(event):
            checked.append(event)
    return checked


async def fetch_in_channel(ctx: Context, event_id: str, channel_id: str, *, what: str
                           ) -> SignedEvent:
    """The verified event `event_id`, a channel message (`READ_KINDS`) in `channel_id`
    (`in_channel`).

    Raises:
      OperationRefused(action_failed): not found (or unverifiable), in another channel, not
        of a kind channel.read returns, or the relay could not be read. `what` names it in
        the agent's message ("the message replied to"); it is our fixed text, never the
        agent's.
    """
    found = await fetch(ctx, {"ids": [event_id], "limit": 1})
    event = next((e for e in found if e.id == event_id), None)
    if event is None:
        raise OperationRefused(ErrorCode.ACTION_FAILED, f"{what} was not found")
    if not in_channel(event.tags, channel_id):
        raise OperationRefused(ErrorCode.ACTION_FAILED, f"{what} is not in this channel")
    if event.kind not in READ_KINDS:
        raise OperationRefused(ErrorCode.ACTION_FAILED, f"{what} is not a channel message",
                               detail=f"event {event.id} is kind {event.kind}")
    return event


async def sign_all(ctx: Context, drafts: Sequence[tuple[str, int, Sequence[Tag], str, int]]
                   ) -> list[SignedEvent]:
    """Sign several events (author, kind, tags, content, created_at) in one custody hop."""
    batch = [
        (author, UnsignedEvent(pubkey=author, created_at=created_at, kind=kind,
                               tags=tuple(tuple(t) for t in tags), content=content))
        for author, kind, tags, content, created_at in drafts
    ]
    return await ctx.signer.sign(batch)
