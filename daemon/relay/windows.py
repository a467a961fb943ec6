"""Read windows: the newest page of a channel, kept true by a live subscription.

Why (issue 24 "Polling that costs almost nothing"): Buzz's runtime polls `channel.read`
(limit 100, no cursor) per channel per second, and without a cursor every poll asks for
the same default window. Measured before this module (docs/performance.md "Read
windows"), a read's CPU goes almost all to the events: WebSocket frames, JSON, the
contract parse, the id hash and the answer's encoding, about 0.1 ms per event; the relay
round trip itself is small. A window does that work once per event, not once per poll.

Theory of operation:

* One `Window` per (agent, channel, mentionsOnly): `WindowKey`. The agent is part of the
  key, and the window's subscription is opened on that agent's own relay connection,
  under that agent's AUTH: the relay decides what each pubkey may see, so one agent's
  window never answers another's read.
* Opening: a live REQ first (the read's own filters with ``limit`` 1, plus deletions and
  this agent's removals in the channel), then the exact page read as a cold read does it
  (daemon/relay/paging.py, every event judged by channel_read's checks). Events the live
  subscription delivers meanwhile are merged after the page, so nothing published between
  the two is missed; a deletion or removal meanwhile, the subscription ending, or more
  than `depth` items judged before the page is in (kept or dropped: a relay ignoring
  `limit`, or flooding forged events), and the page answers this read but is not kept. A
  window that ends before `subscribe` returns closes its subscription then (`attach`).
* Kept true: every live message event is judged (shape, id, signature, size, channel,
  filter) once, then placed in declared order; the window holds the newest events down to
  its bottom (at most `keep`), or all of them when the channel has fewer. A live deletion
  (kind 5, NIP-29 kind 9005) naming an event of the window, a live NIP-29 removal (kind
  9001) of the agent, the relay's CLOSED, or a dropped connection takes the whole window
  away: the next read is cold and the relay says what is true. A window is also checked
  against the relay once it is `max_age` old (jittered down by up to a quarter, so
  windows opened together are not checked together), which bounds what a relay that drops
  a member silently (no CLOSED, no 9001) can leave in it: the channel's newest few events
  are read afresh under the agent's AUTH (channel_read.CONFIRM_EVENTS), and the window is
  kept (continuation pages included) only when they are its own first events
  (`Window.confirms`), else dropped and opened anew. A relay that no longer serves the
  agent answers none, or refuses. Newer events the check finds are placed from it; events
  that arrived live while it was read are left out of the comparison.
* Continuations: Buzz's runtime follows `nextCursor` back through a channel before it
  reads the default window again (buzz-client.md), so with a channel past one page every
  other poll of a fleet is a cursor read of the next older page. When such a read
  continues exactly from the window's bottom, its page (read from the relay, judged as
  any) is appended, unless a live event fell below the bottom, or a live deletion naming
  no event of the window arrived, while it was read (either may or may not be reflected
  in that page: `Continuation`). The window is then exact down to the
  page's end, and the next such read is answered from it.
* Served: a read with a limit up to `depth`, with no cursor or a cursor inside the window,
  gets the window's events after that position, cut by `limit` and the page's byte bound
  as daemon/relay/paging.py cuts, and a cursor at its last one when more exist: exactly
  the page a cold read of the same relay state returns. A page that runs past the
  window's bottom while the relay holds more is not served (the relay is read).
* Encoded and held once: each distinct event (id and signature) is held once by the cache,
  with its canonical encoded bytes, however many windows name it (`WindowCache.hold`);
  an answer is those bytes joined, so a changed window costs its new events, and the
  default page of the last limit served is kept whole (events, position, bytes) until
  the window changes (`Window.serve`).
* Bounded: the windows' estimated bytes together (`max_bytes`, ``[relay]
  read_window_bytes``; each held event once, plus each window's references and its kept
  page) evict least recently used windows; a window alone above it is not kept, and
  evicts no other. How many channels agents
  name changes nothing: a window that does not fit is simply not kept. The relay's
  per-connection subscription cap is the pool's (`RelayPool.subscribe` raises
  SubscriptionsFull): past it the read is a plain query.

What is not here: credential scope and revocation. The pipeline authenticates and
authorizes every request before the operation runs (daemon/pipeline/broker.py), so a
window is only ever consulted for a request already allowed to read that channel.

WARNING: `Window.event` runs inside the relay connection's reader task: it must not
await, block or raise.
"""

from __future__ import annotations

import bisect
import json
import logging
import random
from collections import OrderedDict
from itertools import accumulate
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import trio

from buzzwire import kinds
from buzzwire.contract import Event
from daemon.fault_log import FaultLog
from daemon.relay.cursor import Position
from daemon.relay.paging import Page, SortKey, order_key
from daemon.relay.pool import (
    LiveSubscription,
    RelayError,
    RelayPool,
    decoded_size,
)

__all__ = [
    "DEFAULT_KEEP",
    "DEFAULT_WINDOW_BYTES",
    "Continuation",
    "DELETION_KINDS",
    "REMOVAL_KINDS",
    "Served",
    "Window",
    "WindowCache",
    "WindowKey",
    "encode_event",
]

_log = logging.getLogger("buzz_broker.read")

#: Default of ``[relay] read_window_bytes``: 256 windows of 100 small messages (~1.5 KB
#: each as estimated) fit in about 40 MB; 64 MiB leaves room for larger ones.
DEFAULT_WINDOW_BYTES = 64 * 1024 * 1024
#: Events that delete others in a channel: NIP-09 kind 5 and NIP-29 kind 9005.
DELETION_KINDS: tuple[int, ...] = (kinds.DELETION, kinds.DELETE_EVENT)
#: NIP-29 remove-user; a live one naming the agent ends the agent's windows in the channel.
REMOVAL_KINDS: tuple[int, ...] = (kinds.REMOVE_USER,)
#: What a window costs beyond its events and its kept page (the object, its lists and set).
_WINDOW_OVERHEAD = 4096
#: What a kept default page costs beyond its bytes and its tuple's slots (`_served_cost`).
_SERVED_OVERHEAD = 200
#: What one window's reference to a held event costs (its sort key, list slots, id in the
#: window's set): the event itself is held once however many windows name it.
_REF_COST = 160
#: Events one window keeps by default: its newest page and the older pages a cursor
#: continuation reads next (Buzz's runtime follows `nextCursor` back through the channel
#: before it reads the default window again, buzz-client.md), ten pages of 100.
DEFAULT_KEEP = 1000
#: A window's refill age is jittered down to this fraction of `max_age`, so windows opened
#: together (a fleet starting) do not refill in the same second.
_AGE_JITTER = 0.25

#: judge(relay item) -> the deliverable event, or None (channel_read's checks; they log).
Accept = Callable[[Mapping[str, object]], Event | None]


class WindowKey(NamedTuple):
    """Whose window of what. A tuple, not a dataclass: a poll hashes it three times, and
    a tuple of strings hashes in C (their hashes cached) where a dataclass runs Python."""

    agent: str
    channel_id: str
    mentions_only: bool


@dataclass(frozen=True, slots=True)
class Served:
    """A read answered from a window: the page, and its outcome's encoded form."""

    messages: tuple[Event, ...]
    next_position: Position | None
    #: the `outcome` member's bytes without nextCursor: `{"messages":[...]` (no closing
    #: brace, so the read may append its own cursor). See `Window.serve`.
    encoded_messages: bytes


def _served_cost(served: Served) -> int:
    """Estimated bytes a kept default page takes: its joined bytes and its tuple."""
    return len(served.encoded_messages) + 8 * len(served.messages) + _SERVED_OVERHEAD


def _event_cost(event: Event, encoded: bytes) -> int:
    """Estimated bytes one held event takes: its objects and its encoded form."""
    return decoded_size(event.to_json_obj()) + 2 * len(encoded)


def encode_event(event: Event) -> bytes:
    """One event as an answer carries it: the canonical form (contract
    _envelopes._dumps). A page's messages are these joined by commas, exactly as the
    list's own dumps would write them; channel_read measures an event by it too."""
    return json.dumps(event.to_json_obj(), separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


class _Held:
    """One distinct signed event (id and signature) held by one or more windows."""

    __slots__ = ("event", "encoded", "cost", "refs", "_sized_by", "_size")

    def __init__(self, event: Event) -> None:
        self.event = event
        self.encoded = encode_event(event)
        self.cost = _event_cost(event, self.encoded)
        self.refs = 0
        self._sized_by: Callable[[Event], int] | None = None
        self._size = 0

    def size(self, size_of: Callable[[Event], int]) -> int:
        """`size_of(event)`, computed once for the windows that all measure alike (the
        same id and signature are the same event, so the same size)."""
        if self._sized_by is not size_of:
            self._size, self._sized_by = size_of(self.event), size_of
        return self._size


@dataclass(frozen=True, slots=True)
class Continuation:
    """A window's bottom when a cursor read continues from it: `Window.extend` appends
    that read's page only if nothing below the window changed meanwhile."""

    key: SortKey
    changes_below: int


class Window:
    """The newest events of one (agent, channel, mentionsOnly), kept by its live
    subscription; the `LiveSink` of that subscription.

    The window is the exact declared-order sequence of the channel's events from the
    newest down to its bottom; `_more` says whether the relay holds more below it. Any
    page inside it, from the top or after a cursor position, is then what a cold read
    returns (`serve`).
    """

    def __init__(self, cache: WindowCache, key: WindowKey, accept: Accept, depth: int,
                 max_page_bytes: int, size_of: Callable[[Event], int], keep: int) -> None:
        self.key = key
        self._cache = cache
        self._accept = accept
        self._depth = depth
        self._keep = keep
        self._max_page_bytes = max_page_bytes
        self._size_of = size_of
        # Parallel lists, newest first, one slot per event: a page is slices of them, so a
        # poll costs C-level slicing and joining, not a Python loop over 100 events.
        self._keys: list[SortKey] = []
        self._held: list[_Held] = []
        self._sizes: list[int] = []
        self._events: list[Event] = []
        self._blobs: list[bytes] = []
        self._ids: set[str] = set()
        #: more events exist below the window (the channel holds more than it keeps)
        self._more = False
        self._filled = False
        #: live events dropped because they fell below the window's bottom, and live
        #: deletions that named none of its events: what a continuation read may have missed
        self._changes_below = 0
        #: live events that arrived before the page was read
        self._pending: list[Event] = []
        self._pending_bytes = 0
        #: items judged before the page was in, kept or not (`event`)
        self._judged_filling = 0
        self.valid = True
        self.kept = False
        self.filled_at = 0.0
        self.max_age = 0.0
        self.subscription: LiveSubscription | None = None
        #: the default page of the last limit served, kept until the window changes
        #: (`_clear_page`); one, so an agent cycling limits costs CPU, not memory
        self._page_cache: tuple[int, Served] | None = None
        #: what this window would count in the cache alone: its events, its references
        #: and its kept page (`WindowCache._evict` ends one that could never fit)
        self.own_bytes = 0
        #: ids placed live while a check (`begin_check`, `confirms`) is being read
        self._arrived: set[str] | None = None

    # LiveSink ------------------------------------------------------------------------

    def event(self, item: dict[str, object], *, live: bool) -> None:
        if not self.valid:
            return
        kind = item.get("kind")
        if kind in DELETION_KINDS or kind in REMOVAL_KINDS:
            # Stored ones (before EOSE) are history the page read below already reflects.
            if live and (kind in REMOVAL_KINDS or not self._filled
                         or not self._ids.isdisjoint(_tag_values(item, "e"))):
                self.end("deletion" if kind in DELETION_KINDS else "removal")
            elif live and self._more:
                # It may name an event below the window that a continuation read now in
                # flight was answered before: that page must not extend the window.
                self._changes_below += 1
            return
        if not self._filled:
            # Every item judged before the page is in counts, kept or dropped: a relay that
            # ignores the live REQ's `limit`, or floods it with forged events (each a
            # signature check, never cached), costs one opening `depth` judgements at most.
            self._judged_filling += 1
            if self._judged_filling > self._depth:
                self.end("too many events while filling")
                return
        event = self._accept(item)
        if event is None:
            return
        if not self._filled:
            self._pending_bytes += self._size_of(event)
            if self._pending_bytes > self._max_page_bytes:
                self.end("too many events while filling")
            else:
                self._pending.append(event)
            return
        self._place(event)
        if self._arrived is not None and len(self._arrived) < self._keep:
            self._arrived.add(event.id)
        self._cache.resized(self)

    def ended(self, reason: str) -> None:
        self.end(reason)

    # --------------------------------------------------------------------------------

    def attach(self, subscription: LiveSubscription) -> None:
        """Hold the live subscription `RelayPool.subscribe` returned for this window. The
        window may have ended before it returned (`event` ends it for too many stored
        events, or a live deletion after EOSE), when `end` had nothing to close: the
        subscription is closed now, or it would hold a slot of the agent's connection
        (and keep it from idle close) for as long as the connection lives."""
        self.subscription = subscription
        if not self.valid:
            subscription.close()

    def end(self, reason: str) -> None:
        """Take the window away (and close its subscription); idempotent."""
        if not self.valid:
            return
        self.valid = False
        self._cache.dropped.record((reason,), agent=self.key.agent,
                                   channel_id=self.key.channel_id, reason=reason)
        if self.subscription is not None:
            self.subscription.close()
        self._cache.forget(self)
        for held in self._held:
            self._release(held)
        self._held, self._keys, self._sizes, self._events, self._blobs = [], [], [], [], []
        self._ids.clear()
        self._clear_page()
        self.own_bytes = 0

    def fill(self, page: Page[Event]) -> bool:
        """Take the cold read's page as the window's content; False when it cannot be
        kept (it is not exact, or the window ended while the page was read)."""
        if not self.valid or page.overflow_seconds or (not page.items and page.next_position):
            return False
        for event in page.items:
            self._insert(event)
        self._more = page.next_position is not None
        self._filled = True
        pending, self._pending = self._pending, []
        for event in pending:
            self._place(event)
        return True

    def _insert(self, event: Event) -> None:
        key = order_key(event.created_at, event.id)
        at = bisect.bisect_left(self._keys, key)
        held = self._hold(event)
        self._keys.insert(at, key)
        self._held.insert(at, held)
        self._sizes.insert(at, held.size(self._size_of))
        self._events.insert(at, held.event)
        self._blobs.insert(at, held.encoded)
        self._ids.add(event.id)

    def _hold(self, event: Event) -> _Held:
        held = self._cache.hold(event)
        self.own_bytes += held.cost + _REF_COST
        return held

    def _release(self, held: _Held) -> None:
        self.own_bytes -= held.cost + _REF_COST
        self._cache.release(held)

    def _clear_page(self) -> None:
        if self._page_cache is not None:
            cost = _served_cost(self._page_cache[1])
            self.own_bytes -= cost
            self._cache.bytes -= cost
            self._page_cache = None

    def _append(self, event: Event) -> None:
        held = self._hold(event)
        self._keys.append(order_key(event.created_at, event.id))
        self._held.append(held)
        self._sizes.append(held.size(self._size_of))
        self._events.append(held.event)
        self._blobs.append(held.encoded)
        self._ids.add(event.id)

    def _drop_bottom(self) -> None:
        held = self._held.pop()
        self._keys.pop()
        self._sizes.pop()
        self._events.pop()
        self._blobs.pop()
        self._ids.discard(held.event.id)
        self._release(held)
        self._more = True

    def _place(self, event: Event) -> None:
        """One live event: into the window if it is above its bottom, else nothing."""
        if event.id in self._ids:
            return
        key = order_key(event.created_at, event.id)
        if self._more and self._keys and key > self._keys[-1]:
            # Below the window: a cursor read finds it on the relay; a continuation read
            # now in flight may or may not have, so it must not extend the window.
            self._changes_below += 1
            return
        self._insert(event)
        # What falls off the bottom still exists, so a cursor is due from there on.
        while len(self._held) > self._keep:
            self._drop_bottom()
        self._clear_page()

    def begin_check(self) -> None:
        """A check's read starts: events arriving live meanwhile are noted, since the
        relay's answer may or may not include them (`confirms`)."""
        self._arrived = set()

    def confirms(self, page: Page[Event]) -> bool:
        """The relay's newest events, read afresh under this agent's AUTH since
        `begin_check`, are this window's own first events: what the window holds is still
        what the agent may read."""
        arrived, self._arrived = self._arrived or set(), None
        if not self.valid or page.overflow_seconds:
            return False
        # Events newer than the window's newest that it lacks were published while the
        # check was read and are still on their way live: the relay's answer, read under
        # this agent's AUTH, places them now (their live copy is then a duplicate).
        newer = [event for event in page.items if event.id not in self._ids
                 and self._keys and order_key(event.created_at, event.id) < self._keys[0]]
        if newer:
            for event in newer:
                self._place(event)
            self._cache.resized(self)
            if not self.valid:
                return False
        # Events that arrived live during the read may be in the relay's answer or not:
        # they are left out of both sides.
        given = [(e.id, e.sig) for e in page.items if e.id not in arrived]
        kept = [(h.event.id, h.event.sig) for h in self._held if h.event.id not in arrived]
        # Where the two end must agree too: the relay's page stops short of the window
        # only when it was cut (a cursor), and runs past it only when the window knows
        # more exist below; equal lengths need the same word on "more".
        if len(given) < len(kept) and page.next_position is None:
            return False
        if len(given) > len(kept) and not self._more:
            return False
        if len(given) == len(kept) and (page.next_position is not None) != self._more:
            return False
        overlap = min(len(given), len(kept))
        return given[:overlap] == kept[:overlap]

    def continuation(self, after: Position) -> Continuation | None:
        """When a cursor read after `after` cannot be served because it continues from
        this window's bottom: the mark `extend` checks. None otherwise."""
        if not self.valid or not self._more or not self._keys or len(self._held) >= self._keep:
            return None
        key = order_key(after.created_at, after.event_id)
        if key != self._keys[-1]:
            return None
        return Continuation(key=key, changes_below=self._changes_below)

    def extend(self, mark: Continuation, page: Page[Event]) -> None:
        """Append the cold page read after the window's bottom (`mark`): the window then
        stays exact down to the page's end. Nothing happens when the window changed below
        its bottom meanwhile, ended, or the page is not exact."""
        if (not self.valid or not self._more or not self._keys or self._keys[-1] != mark.key
                or self._changes_below != mark.changes_below or page.overflow_seconds
                or not page.items):
            return
        for event in page.items:
            key = order_key(event.created_at, event.id)
            if key <= self._keys[-1] or event.id in self._ids:
                return  # not strictly below: not the continuation this window expects
        for event in page.items:
            self._append(event)
        self._more = page.next_position is not None
        while len(self._held) > self._keep:
            self._drop_bottom()
        self._clear_page()
        self._cache.resized(self)

    def serve(self, limit: int, after: Position | None = None) -> Served | None:
        """The page a cold read with `limit` (<= depth) after `after` (None: the newest)
        would return now; None when the window does not hold it (a continuation below
        the window's bottom)."""
        if after is None:
            # The default page is the same until the window changes (every change clears
            # it): an unchanged window's poll is one lookup.
            if self._page_cache is not None and self._page_cache[0] == limit:
                return self._page_cache[1]
            page = self._page(limit, 0)
            if page is not None and self.kept:
                self._clear_page()
                self._page_cache = (limit, page)
                cost = _served_cost(page)
                self.own_bytes += cost
                self._cache.bytes += cost
                self._cache.resized(self)  # may end this window: the page still answers
            return page
        start = bisect.bisect_right(self._keys, order_key(after.created_at, after.event_id))
        return self._page(limit, start)

    def _page(self, limit: int, start: int) -> Served | None:
        # The page's own bounds, as daemon/relay/paging.py cuts them: `limit` events, and
        # the byte bound before the event that would cross it (at least one event). Sizes
        # are positive, so their running sums rise and the bound is one bisection.
        stop = min(len(self._held), start + limit)
        end, cut = start, False
        if start < stop:
            sums = list(accumulate(self._sizes[start:stop]))
            end = start + max(1, bisect.bisect_right(sums, self._max_page_bytes))
            cut = end < stop
        if end - start < limit and not cut and self._more:
            return None  # the relay holds the rest of this page below the window
        messages = tuple(self._events[start:end])
        position = None
        if messages and (cut or end < len(self._held) or self._more):
            last = messages[-1]
            position = Position(created_at=last.created_at, event_id=last.id)
        # Joined from each event's encoded form, made once per distinct event: a changed
        # window costs its new events, not the whole page.
        encoded = b'{"messages":[' + b",".join(self._blobs[start:end]) + b"]"
        return Served(messages=messages, next_position=position, encoded_messages=encoded)


def _tag_values(item: Mapping[str, object], letter: str) -> set[str]:
    tags = item.get("tags")
    if not isinstance(tags, list):
        return set()
    return {tag[1] for tag in tags
            if isinstance(tag, list) and len(tag) >= 2 and tag[0] == letter
            and isinstance(tag[1], str)}


class WindowCache:
    """Every open window, least recently used first, within `max_bytes` together.

    The bytes counted: each window's overhead and its references, and each distinct
    signed event (id and signature) once, however many windows hold it (`hold`,
    `release`): a fleet whose agents all read the same channels holds each event once.

    Args:
        pool: whose connections carry the windows' live subscriptions.
        max_bytes: the windows' estimated bytes together (0: no windows at all).
        depth: the largest `limit` a window answers (reads with a larger limit go to the
            relay), and the page a window opens with.
        keep: events one window keeps at most (its newest page and the continuation pages
            cursor reads have read after it).
        max_age: seconds after which a window is refilled from the relay (each window's
            own age is jittered down by up to a quarter, so refills spread out).
        idle_seconds: a window not served this long is closed (checked on each read).
    """

    def __init__(self, pool: RelayPool, *, max_bytes: int = DEFAULT_WINDOW_BYTES,
                 depth: int = 100, keep: int = DEFAULT_KEEP, max_age: float = 60.0,
                 idle_seconds: float = 300.0) -> None:
        if max_bytes < 0 or depth < 1 or keep < depth or max_age <= 0 or idle_seconds <= 0:
            raise ValueError("WindowCache needs max_bytes >= 0, 1 <= depth <= keep and positive ages")
        self._pool = pool
        self.max_bytes = max_bytes
        self.depth = depth
        self.keep = keep
        self._max_age = max_age
        self._idle = idle_seconds
        self._windows: OrderedDict[WindowKey, Window] = OrderedDict()
        self._served_at: dict[WindowKey, float] = {}
        self._opening: set[WindowKey] = set()
        self._held: dict[tuple[str, str], _Held] = {}
        self._jitter = random.Random()
        self.bytes = 0
        # A relay that is down or closes every subscription does so to every poll of a
        # fleet: one line a minute per reason (a fixed word each), then a count.
        self.dropped = FaultLog(_log, "read.window_dropped", level=logging.INFO)
        self.not_opened = FaultLog(_log, "read.window_not_opened", level=logging.INFO)

    def __len__(self) -> int:
        return len(self._windows)

    def hold(self, event: Event) -> _Held:
        """The shared copy of `event` (same id and signature), one reference more."""
        held = self._held.get((event.id, event.sig))
        if held is None:
            held = self._held[(event.id, event.sig)] = _Held(event)
            self.bytes += held.cost
        held.refs += 1
        self.bytes += _REF_COST
        return held

    def release(self, held: _Held) -> None:
        held.refs -= 1
        self.bytes -= _REF_COST
        if held.refs == 0 and self._held.get((held.event.id, held.event.sig)) is held:
            del self._held[(held.event.id, held.event.sig)]
            self.bytes -= held.cost

    def due(self, window: Window) -> bool:
        """The window is `max_age` old: it must be confirmed against the relay (`renew`)
        or dropped before it answers again."""
        return trio.current_time() - window.filled_at >= window.max_age

    def renew(self, window: Window) -> None:
        """The relay's newest page matched the window (`Window.confirms`): age it afresh."""
        window.filled_at = trio.current_time()
        window.max_age = self._max_age * (1.0 - _AGE_JITTER * self._jitter.random())

    def get(self, key: WindowKey) -> Window | None:
        """The key's window if it is kept (fresh or `due`); marks it most recently used."""
        now = trio.current_time()
        while self._windows:
            oldest_key, oldest = next(iter(self._windows.items()))
            if now - self._served_at.get(oldest_key, now) < self._idle:
                break
            oldest.end("idle")
        window = self._windows.get(key)
        if window is None:
            return None
        self._windows.move_to_end(key)
        self._served_at[key] = now
        return window

    async def open(self, key: WindowKey, filters: Sequence[Mapping[str, object]],
                   accept: Accept, read: Callable[[], Awaitable[Page[Event]]], *,
                   max_page_bytes: int, size_of: Callable[[Event], int]
                   ) -> tuple[Page[Event], Window | None]:
        """Open a window for `key` and read its first page with `read`.

        Returns the page `read` returned (the cold read's answer) and the window, or None
        when no window could be kept: then the page is all there is (a plain read).
        Whatever `read` raises propagates; a window being opened is then dropped.
        """
        if self.max_bytes == 0 or key in self._opening:
            return await read(), None
        window = Window(self, key, accept, self.depth, max_page_bytes, size_of, self.keep)
        self._opening.add(key)
        try:
            try:
                window.attach(await self._pool.subscribe(
                    key.agent, self._live_filters(key, filters), window))
            except RelayError as exc:
                # Subscriptions full, refused or unavailable: the plain read answers (and
                # reports the relay's failure itself, as it always did).
                self.not_opened.record((type(exc).__name__,), agent=key.agent,
                                       channel_id=key.channel_id, reason=type(exc).__name__)
                window.valid = False
                return await read(), None
            if not window.valid:
                # It ended while subscribing (`attach` closed the subscription): the plain
                # read answers.
                return await read(), None
            try:
                page = await read()
            except BaseException:
                window.end("cold read failed")
                raise
            if not window.fill(page):
                window.end("not kept")
                return page, None
            self.renew(window)
            self._keep(window)
            return page, (window if window.valid else None)
        finally:
            self._opening.discard(key)

    @staticmethod
    def _live_filters(key: WindowKey, filters: Sequence[Mapping[str, object]]
                      ) -> list[dict[str, object]]:
        # `limit` 1: the stored part of a live REQ is not wanted (the page read follows);
        # 1 rather than 0, which relays read differently.
        live: list[dict[str, object]] = [{**flt, "limit": 1} for flt in filters]
        live.append({"kinds": list(DELETION_KINDS), "#h": [key.channel_id], "limit": 1})
        live.append({"kinds": list(REMOVAL_KINDS), "#h": [key.channel_id],
                     "#p": [key.agent], "limit": 1})
        return live

    def _keep(self, window: Window) -> None:
        old = self._windows.get(window.key)
        if old is not None and old is not window:
            old.end("replaced")
        self._windows[window.key] = window
        self._served_at[window.key] = trio.current_time()
        window.kept = True
        self.bytes += _WINDOW_OVERHEAD
        self._evict(window)

    def resized(self, window: Window) -> None:
        """A window's events changed: evict past the bound."""
        self._evict(window)

    def _evict(self, window: Window) -> None:
        # A window that would not fit alone goes by itself: evicting the others first
        # would leave nothing kept, and one agent's large channel would empty every
        # agent's windows at each of its polls.
        if window.kept and window.own_bytes + _WINDOW_OVERHEAD > self.max_bytes:
            window.end("larger than read_window_bytes alone")
        while self.bytes > self.max_bytes and self._windows:
            _, oldest = next(iter(self._windows.items()))
            oldest.end("evicted (read_window_bytes)")

    def forget(self, window: Window) -> None:
        if window.kept:
            window.kept = False
            self.bytes -= _WINDOW_OVERHEAD
            if self._windows.get(window.key) is window:
                del self._windows[window.key]
                self._served_at.pop(window.key, None)

    def close(self) -> None:
        """End every window (the daemon is stopping)."""
        for window in list(self._windows.values()):
            window.end("closing")
