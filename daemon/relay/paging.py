"""Exact newest-first paging over a NIP-01 relay that cuts `limit` anywhere inside a second.

Theory of operation (design.md "Reads and cursors"; buzz-on-the-relay.md "Reading"):

The declared order is (created_at DESC, id ASC), as Buzz orders channel events. A page
that ended at position P = (t, id_P) is followed by the events strictly after P in that
order: created_at < t, or created_at == t and id > id_P.

A NIP-01 relay answers `limit: n` with the n newest events, but inside one second it cuts
wherever it likes, and `since`/`until` are inclusive. So for a reply that filled its
limit, the *oldest second* in it (the boundary) may be incomplete, while every newer
second in it is complete (the relay ordered by created_at before cutting). A reply that
did not fill its limit is complete down to the bottom of its window.

The driver keeps one invariant: `out` is exactly the declared-order sequence of events
after P, down to a frontier, with nothing missing. Each round sends ONE request holding,
for every base filter,

* a *sweep* of the pending boundary second s (`since = until = s`, limit = relay cap):
  all of second s. On the first round of a cursor page s = t and only ids > id_P count;
* a *main* query strictly below it (`until = s - 1`, or no `until` on a first page),
  limit = what is still wanted + READ_AHEAD.

The sweep part is appended whole; of the main part, only the seconds newer than its
boundary B are appended, and B becomes the next round's sweep. If the main part did not
fill its limit, everything is known and the page is exhausted. Windows of successive
rounds are disjoint, so nothing repeats; each appended window is complete, so nothing is
skipped. Rounds stop once limit+1 events are known: the +1 is how `nextCursor` is
present only when more exists.

Bytes: a page may also be cut by `max_bytes` (the sum of `size_of` over its items): once
the next item would cross it, the page ends there with a cursor from its last item, exactly
as when the round bound is hit. A page holds at least one item, so a single item larger
than the bound still gets through (alone): paging never stalls.

Answers too large: a relay answer past the pool's per-query bound (pool.AnswerTooLarge:
MAX_QUERY_BYTES of decoded objects; a channel member's messages of 2,000 one-letter tags
are ~361 KB each there, so 46 of them filled it) is asked again with half the main
query's `ask` (down to 1), then half the sweep's limit (down to 1). The smaller `ask`
holds for the rest of the page: it only moves the main part's boundary up (a reply that
fills its ask is cut, as any), so the page ends sooner, with a cursor from its frontier,
and nothing is skipped or concluded from it. A smaller sweep limit holds for that second
alone: a sweep smaller than the relay's cap that comes back full may be missing part of
its second, which counts as an overflow second (below), and a later second swept so small
would lose events for no cause of its own (a review: a member's tag-heavy second cut an
ordinary one below it). Past limit 1 on both, the read fails as before.

The one case that cannot page exactly: a second holding at least the relay's per-filter
cap (RELAY_MAX_LIMIT, 500 on Buzz) matching events — the sweep can only see a cap-sized
subset (or, its answer too large, a sweep limit smaller than the cap). It is detected
(`Page.overflow_seconds`) for the caller to log; paging goes on.

Everything the relay returns is judged here only structurally (an `id` of 64 hex, an int
`created_at` in 0..MAX_CREATED_AT, within the window). Whether an event may be delivered
is the caller's `accept` callback (signature, channel tag, filter). An item inside the
main window that cannot be attributed to a filter (no usable id / created_at, or matching
none of them) still counts against every filter's limit (the relay may have counted it),
which can only cause an extra sweep, never a skipped event. An item with a usable created_at outside
every window is dropped without counting: no honest relay picked it for this request.

This module is pure except `read_page`, which awaits the caller's `query` callable, and a
trio checkpoint every ACCEPTS_PER_CHECKPOINT `accept` calls, and nothing else (no clock, no
logging, no sockets).

WARNING: `matches` implements only the filter members the read path builds (ids,
authors, kinds, since, until, single-letter tags). Adding a member to the filters built
in operations/channel_read.py means adding it here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Generic, TypeVar

import trio

from buzzwire.contract import MAX_JSON_INT
from daemon.relay.cursor import Position
from daemon.relay.pool import AnswerTooLarge

__all__ = [
    "ACCEPTS_PER_CHECKPOINT",
    "MAX_CREATED_AT",
    "MAX_ROUNDS",
    "READ_AHEAD",
    "RELAY_MAX_LIMIT",
    "Page",
    "RelayMisbehaved",
    "Query",
    "matches",
    "order_key",
    "read_page",
]

#: Buzz's relay returns at most 500 events per filter (buzz-on-the-relay.md "Relay
#: connection"); a reply of this many is treated as cut.
RELAY_MAX_LIMIT = 500
#: Ask the main query for one more than still wanted: when the oldest second of the reply
#: holds a single event, the page is complete in one round trip (sparse channels).
READ_AHEAD = 1
#: Round trips one page may take before it returns what it has (a short page with a
#: cursor — still exact). Bounds the work a hostile or broken relay can cause.
MAX_ROUNDS = 8
#: The latest created_at paging places: the contract's bound on a JSON integer, so on an
#: `Event`'s created_at (NIP-01: unix seconds). An item past it is malformed, as one with no
#: int created_at, and could never be delivered; placed, it made a boundary whose position
#: (B + 1 for a page that delivered nothing) a cursor's u64 cannot hold (`Position`).
MAX_CREATED_AT = MAX_JSON_INT
#: `accept` calls between two yields to the event loop: `accept` may check a BIP-340
#: signature each (about 70 µs), and one read may judge MAX_ROUNDS replies of up to
#: pool.MAX_EVENTS_PER_QUERY items; without a yield, one relay's reply stalls every
#: other agent for its whole judging (measured 0.74-1.45 s for 40,000 items).
ACCEPTS_PER_CHECKPOINT = 64
#: The greatest id: a position (s + 1, _MAX_ID) means "everything at second s is still to come".
_MAX_ID = "f" * 64
_HEX = frozenset("0123456789abcdef")

T = TypeVar("T")
Filter = Mapping[str, object]
#: The relay read the driver awaits: one REQ with these filters, every event until EOSE.
Query = Callable[[list[dict[str, object]]], Awaitable[Sequence[object]]]
#: (-created_at, id): ascending sort of this key is the declared order.
SortKey = tuple[int, str]


class RelayMisbehaved(Exception):
    """The relay's reply cannot be read as an honest relay's: `reason` is a fixed word.
    Raised here when the relay filled a limit with nothing that has a usable id and
    created_at, so no boundary can be placed ("no_boundary"); `accept` may raise it too
    (channel_read: "forged_events"). The caller reports the read as failed."""

    def __init__(self, reason: str = "no_boundary") -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Page(Generic[T]):
    """One page: `items` in declared order; `next_position` only when more exists."""

    items: tuple[T, ...]
    next_position: Position | None
    rounds: int
    overflow_seconds: tuple[int, ...] = ()
    #: items without a usable id / created_at, or outside the window asked for
    malformed: int = 0
    #: the page ended early because its items reached `max_bytes`
    cut_by_bytes: bool = False


def order_key(created_at: int, event_id: str) -> SortKey:
    return (-created_at, event_id)


def _key_unchecked(item: object) -> SortKey | None:
    """The sort key of a relay item, or None when it has no usable id / created_at."""
    if not isinstance(item, Mapping):
        return None
    created_at = item.get("created_at")
    event_id = item.get("id")
    if type(created_at) is not int or not 0 <= created_at <= MAX_CREATED_AT:
        return None
    if not isinstance(event_id, str) or len(event_id) != 64 or not set(event_id) <= _HEX:
        return None
    return order_key(created_at, event_id)


def matches(item: Mapping[str, object], flt: Filter) -> bool:
    """NIP-01 filter semantics for the members the read path uses (`limit` ignored)."""
    created_at = item.get("created_at")
    for name, wanted in flt.items():
        if name == "limit":
            continue
        if name in _LIST_MEMBERS:
            if not _contains(wanted, item.get(_LIST_MEMBERS[name])):
                return False
        elif name == "since":
            if type(created_at) is not int or not isinstance(wanted, int) or created_at < wanted:
                return False
        elif name == "until":
            if type(created_at) is not int or not isinstance(wanted, int) or created_at > wanted:
                return False
        elif name.startswith("#") and len(name) == 2:
            if not _has_tag(item, name[1], wanted):
                return False
        else:
            raise ValueError(f"filter member {name!r} is not supported by paging.matches")
    return True


#: filter member -> the event member it lists values of (NIP-01)
_LIST_MEMBERS: Mapping[str, str] = {"ids": "id", "authors": "pubkey", "kinds": "kind"}


def _contains(wanted: object, value: object) -> bool:
    if not isinstance(wanted, list | tuple | set | frozenset):
        return False
    # bool is an int in Python; a kind of `true` must not match kind 1.
    return type(value) is not bool and value in wanted


def _has_tag(item: Mapping[str, object], letter: str, wanted: object) -> bool:
    tags = item.get("tags")
    if not isinstance(tags, list | tuple) or not isinstance(wanted, list | tuple):
        return False
    for tag in tags:
        if isinstance(tag, list | tuple) and len(tag) >= 2 and tag[0] == letter and tag[1] in wanted:
            return True
    return False


@dataclass(frozen=True, slots=True)
class _Round:
    """What one round asks: a sweep of second `sweep` (ids > `sweep_after` count, at most
    `sweep_limit` events) and a main query with `until = upper` (None: unbounded; -1:
    nothing below) and `ask`."""

    sweep: int | None
    sweep_after: str | None
    upper: int | None
    ask: int
    sweep_limit: int

    def smaller(self) -> _Round | None:
        """The same round asking less, for an answer past the relay pool's per-query
        bound: the main part's ask halved first (a smaller ask stays exact), then the
        sweep's limit; None when both are 1 already."""
        if self.has_main and self.ask > 1:
            return replace(self, ask=self.ask // 2)
        if self.sweep is not None and self.sweep_limit > 1:
            return replace(self, sweep_limit=self.sweep_limit // 2)
        return None

    @property
    def has_main(self) -> bool:
        return self.upper is None or self.upper >= 0


def _round_filters(bases: Sequence[Filter], rnd: _Round, cap: int) -> list[dict[str, object]]:
    filters: list[dict[str, object]] = []
    for base in bases:
        if rnd.sweep is not None:
            filters.append({**base, "since": rnd.sweep, "until": rnd.sweep,
                            "limit": rnd.sweep_limit})
        if rnd.has_main:
            main: dict[str, object] = {**base, "limit": rnd.ask}
            if rnd.upper is not None:
                main["until"] = rnd.upper
            filters.append(main)
    return filters


@dataclass(slots=True)
class _Absorbed:
    """The result of judging one round's reply (mutable scratch, never leaves the module)."""

    sweep_part: list[tuple[SortKey, Mapping[str, object]]] = field(default_factory=list)
    main_part: list[tuple[SortKey, Mapping[str, object]]] = field(default_factory=list)
    overflow: bool = False
    #: None: the main part is complete (or absent); else the boundary second B
    boundary: int | None = None
    malformed: int = 0


def _absorb(items: Sequence[object], bases: Sequence[Filter], rnd: _Round, cap: int) -> _Absorbed:
    """Split one reply into the sweep window and the main window, and find where the main
    part was cut. Pure."""
    result = _Absorbed()
    seen: set[str] = set()
    unattributed = 0
    main_counts = [0] * len(bases)
    main_oldest: list[int | None] = [None] * len(bases)
    sweep_counts = [0] * len(bases)
    for item in items:
        key = _key_unchecked(item)
        if key is None:
            unattributed += 1
            result.malformed += 1
            continue
        assert isinstance(item, Mapping)
        created_at, event_id = -key[0], key[1]
        in_sweep = rnd.sweep is not None and created_at == rnd.sweep
        in_main = rnd.has_main and (rnd.upper is None or created_at <= rnd.upper)
        if not (in_sweep or in_main):
            # Outside every window asked: no honest relay selected it for these filters,
            # so it says nothing about where a limit was cut. Dropped, not counted.
            result.malformed += 1
            continue
        # Count each distinct id once: the relay may send one event once per filter that
        # matched it. A copy is still kept below; the driver places each id once.
        if event_id not in seen:
            seen.add(event_id)
            hits = [i for i, base in enumerate(bases) if matches(item, base)]
            if in_sweep:
                for i in hits:
                    sweep_counts[i] += 1
            else:
                if not hits:
                    unattributed += 1
                for i in hits:
                    main_counts[i] += 1
                    oldest = main_oldest[i]
                    main_oldest[i] = created_at if oldest is None else min(oldest, created_at)
        if in_sweep:
            if rnd.sweep_after is None or event_id > rnd.sweep_after:
                result.sweep_part.append((key, item))
        else:
            result.main_part.append((key, item))
    # A full sweep may be cut: at the relay's cap, or at a limit made smaller for an
    # answer too large (`_Round.smaller`).
    result.overflow = any(count >= min(cap, rnd.sweep_limit) for count in sweep_counts)
    if rnd.has_main:
        boundaries: list[int] = []
        fallback = min((-k[0] for k, _ in result.main_part), default=None)
        for i in range(len(bases)):
            if main_counts[i] + unattributed >= rnd.ask:
                oldest = main_oldest[i] if main_oldest[i] is not None else fallback
                if oldest is None:
                    raise RelayMisbehaved()
                boundaries.append(oldest)
        if boundaries:
            result.boundary = max(boundaries)
    result.sweep_part.sort(key=lambda pair: pair[0])
    result.main_part.sort(key=lambda pair: pair[0])
    return result


async def read_page(
    query: Query,
    bases: Sequence[Filter],
    *,
    after: Position | None,
    limit: int,
    accept: Callable[[Mapping[str, object]], T | None],
    cap: int = RELAY_MAX_LIMIT,
    max_rounds: int = MAX_ROUNDS,
    max_bytes: int | None = None,
    size_of: Callable[[T], int] | None = None,
) -> Page[T]:
    """Read the page of events after `after` (None: from the newest) matching any of `bases`.

    Args:
        query: one REQ with the given filters -> every event the relay sent before EOSE.
        bases: the NIP-01 filters without since/until/limit (their union is read).
        after: where the previous page ended.
        limit: 1..cap events per page.
        accept: turns a relay item into a deliverable value, or None to drop it (the
            callback logs why). Called once per distinct event id that paging places.
        cap: the relay's per-filter result cap.
        max_rounds: bound on round trips for this page.
        max_bytes, size_of: cut the page before the item that would take the sum of
            `size_of` over its items past `max_bytes` (None: no byte bound).

    Returns:
        The page; `next_position` is set only when at least one more event is known to
        exist (or the round bound was hit before the page's end was known).

    Raises:
        RelayMisbehaved: the relay's reply gave no usable position to continue from.
        Whatever `query` or `accept` raises (relay unavailable / refused, a relay the
        caller's judge gave up on) propagates unchanged.
    """
    if not 1 <= limit <= cap:
        raise ValueError(f"limit must be in 1..{cap}")
    if not bases:
        raise ValueError("at least one base filter is needed")
    if (max_bytes is None) != (size_of is None):
        raise ValueError("max_bytes and size_of go together")
    held_bytes = 0
    cut_by_bytes = False
    out: list[tuple[SortKey, T]] = []
    placed: set[str] = set()
    overflow: list[int] = []
    malformed = 0
    # The most a main query asks for: lowered for the rest of the page when an answer was
    # too large (`_Round.smaller`), so each size is tried too large once. A sweep's limit
    # starts at `cap` each round (module docstring, "Answers too large").
    max_ask = cap
    if after is None:
        rnd = _Round(sweep=None, sweep_after=None, upper=None, ask=min(cap, limit + 1 + READ_AHEAD),
                     sweep_limit=cap)
    else:
        rnd = _Round(
            sweep=after.created_at,
            sweep_after=after.event_id,
            upper=after.created_at - 1,
            ask=min(cap, limit + 1 + READ_AHEAD),
            sweep_limit=cap,
        )
    rounds = 0
    exhausted = False
    accepted = 0
    while True:
        rounds += 1
        while True:
            try:
                reply = await query(_round_filters(bases, rnd, cap))
                break
            except AnswerTooLarge:
                smaller = rnd.smaller()
                if smaller is None:
                    raise
                rnd = smaller
                max_ask = min(max_ask, rnd.ask)
        absorbed = _absorb(reply, bases, rnd, cap)
        malformed += absorbed.malformed
        if absorbed.overflow and rnd.sweep is not None:
            overflow.append(rnd.sweep)
        cut = absorbed.boundary
        complete_main = [pair for pair in absorbed.main_part if cut is None or -pair[0][0] > cut]
        for key, item in (*absorbed.sweep_part, *complete_main):
            if key[1] in placed:
                continue
            accepted += 1
            if accepted % ACCEPTS_PER_CHECKPOINT == 0:
                await trio.lowlevel.checkpoint()
            value = accept(item)
            if value is None:
                continue
            if size_of is not None and max_bytes is not None:
                size = size_of(value)
                if out and held_bytes + size > max_bytes:
                    cut_by_bytes = True
                    break
                held_bytes += size
            placed.add(key[1])
            out.append((key, value))
        if len(out) > limit or cut_by_bytes:
            break
        if cut is None:
            exhausted = True
            break
        if rounds >= max_rounds:
            break
        wanted = limit + 1 - len(out)
        rnd = _Round(sweep=cut, sweep_after=None, upper=cut - 1,
                     ask=min(cap, wanted + READ_AHEAD, max_ask), sweep_limit=cap)
    items = tuple(value for _, value in out[:limit])
    next_position: Position | None = None
    if len(out) > limit:
        last = out[limit - 1][0]
        next_position = Position(created_at=-last[0], event_id=last[1])
    elif not exhausted or cut_by_bytes:
        # Stopped by the round or byte bound: continue exactly from the frontier.
        if out:
            last = out[-1][0]
            next_position = Position(created_at=-last[0], event_id=last[1])
        else:
            # Nothing delivered; all of second `rnd.sweep` (== cut) and below is to come.
            assert cut is not None
            next_position = Position(created_at=cut + 1, event_id=_MAX_ID)
    return Page(
        items=items,
        next_position=next_position,
        rounds=rounds,
        overflow_seconds=tuple(overflow),
        malformed=malformed,
        cut_by_bytes=cut_by_bytes,
    )
