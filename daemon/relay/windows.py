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
  the two is missed; a deletion or removal meanwhile, or the subscription ending, and the
  page answers this read but is not kept.
* Kept true: every live message event is judged (shape, id, signature, channel, filter)
  once, then placed in declared order; the window holds the newest `depth` events, or all
  of them when the channel has fewer. A live deletion (kind 5, NIP-29 kind 9005) naming an
  event of the window, a live NIP-29 removal (kind 9001) of the agent, the relay's CLOSED,
  or a dropped connection takes the whole window away: the next read is cold and the
  relay says what is true. A window is also refilled from the relay once it is
  `max_age` old, which bounds what a relay that drops a member silently (no CLOSED, no
  9001) can leave in it.
* Served: a read with no cursor and a limit up to `depth` gets the window's first `limit`
  events and, when more exist, a cursor at its last one: exactly the page a cold read of
  the same relay state returns. The answer's outcome is encoded once per window change
  and limit (`Served.encoded`).
* Bounded: the windows' estimated bytes together (`max_bytes`, ``[relay]
  read_window_bytes``) evict least recently used windows; a window alone above it is not
  kept. How many channels agents name changes nothing: a window that does not fit is
  simply not kept. The relay's per-connection subscription cap is the pool's
  (`RelayPool.subscribe` raises SubscriptionsFull): past it the read is a plain query.

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
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

import trio

from buzzwire import kinds
from buzzwire.contract import Event
from daemon.log import log_event
from daemon.relay.cursor import Position
from daemon.relay.paging import Page, SortKey, order_key
from daemon.relay.pool import (
    LiveSubscription,
    RelayError,
    RelayPool,
    decoded_size,
)

__all__ = [
    "DEFAULT_WINDOW_BYTES",
    "DELETION_KINDS",
    "REMOVAL_KINDS",
    "Served",
    "Window",
    "WindowCache",
    "WindowKey",
]

_log = logging.getLogger("buzz_broker.read")

#: Default of ``[relay] read_window_bytes``: 256 windows of 100 small messages (~1.5 KB
#: each as estimated) fit in about 40 MB; 64 MiB leaves room for larger ones.
DEFAULT_WINDOW_BYTES = 64 * 1024 * 1024
#: Events that delete others in a channel: NIP-09 kind 5 and NIP-29 kind 9005.
DELETION_KINDS: tuple[int, ...] = (kinds.DELETION, kinds.DELETE_EVENT)
#: NIP-29 remove-user; a live one naming the agent ends the agent's windows in the channel.
REMOVAL_KINDS: tuple[int, ...] = (kinds.REMOVE_USER,)
#: What a window costs beyond its events (the object, its keys, the encoded answers' dict).
_WINDOW_OVERHEAD = 4096

#: judge(relay item) -> the deliverable event, or None (channel_read's checks; they log).
Accept = Callable[[Mapping[str, object]], Event | None]


@dataclass(frozen=True, slots=True)
class WindowKey:
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


def _event_cost(event: Event) -> int:
    """Estimated bytes one event takes in a window: its objects and its encoded form."""
    obj = event.to_json_obj()
    return decoded_size(obj) + 2 * len(json.dumps(obj, ensure_ascii=False))


class Window:
    """The newest `depth` events of one (agent, channel, mentionsOnly), kept by its live
    subscription; the `LiveSink` of that subscription."""

    def __init__(self, cache: WindowCache, key: WindowKey, accept: Accept, depth: int,
                 max_page_bytes: int, size_of: Callable[[Event], int]) -> None:
        self.key = key
        self._cache = cache
        self._accept = accept
        self._depth = depth
        self._max_page_bytes = max_page_bytes
        self._size_of = size_of
        self._keys: list[SortKey] = []
        self._events: list[Event] = []
        self._ids: set[str] = set()
        self._page_bytes = 0
        #: more events exist below the window (the channel holds more than it keeps)
        self._more = False
        self._filled = False
        #: live events that arrived before the page was read
        self._pending: list[Event] = []
        self._pending_bytes = 0
        self.valid = True
        self.cost = _WINDOW_OVERHEAD
        self.filled_at = 0.0
        self.subscription: LiveSubscription | None = None
        self._encoded: dict[int, bytes] = {}

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
            return
        event = self._accept(item)
        if event is None:
            return
        if not self._filled:
            self._pending_bytes += self._size_of(event)
            if len(self._pending) >= self._depth or self._pending_bytes > self._max_page_bytes:
                self.end("too many events while filling")
            else:
                self._pending.append(event)
            return
        before = self.cost
        self._place(event)
        self._cache.resized(self, self.cost - before)

    def ended(self, reason: str) -> None:
        self.end(reason)

    # --------------------------------------------------------------------------------

    def end(self, reason: str) -> None:
        """Take the window away (and close its subscription); idempotent."""
        if not self.valid:
            return
        self.valid = False
        log_event(_log, "read.window_dropped", agent=self.key.agent,
                  channel_id=self.key.channel_id, reason=reason)
        if self.subscription is not None:
            self.subscription.close()
        self._cache.forget(self)

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
        self._keys.insert(at, key)
        self._events.insert(at, event)
        self._ids.add(event.id)
        self._page_bytes += self._size_of(event)
        self.cost += _event_cost(event)

    def _place(self, event: Event) -> None:
        """One live event: into the window if it is among the newest, else nothing."""
        if event.id in self._ids:
            return
        key = order_key(event.created_at, event.id)
        if self._more and self._keys and key > self._keys[-1]:
            return  # below the window: a cursor read finds it on the relay
        self._insert(event)
        # The page's own bounds (channel_read: `depth` events, MAX_PAGE_BYTES): what falls
        # off the end still exists, so a cursor is due from here on.
        while len(self._events) > self._depth or (
                len(self._events) > 1 and self._page_bytes > self._max_page_bytes):
            dropped = self._events.pop()
            self._keys.pop()
            self._ids.discard(dropped.id)
            self._page_bytes -= self._size_of(dropped)
            self.cost -= _event_cost(dropped)
            self._more = True
        self._encoded.clear()

    def serve(self, limit: int) -> Served:
        """The page a cold read with `limit` (<= depth) would return now."""
        messages = tuple(self._events[:limit])
        position = None
        if len(self._events) > limit or self._more:
            last = messages[-1]
            position = Position(created_at=last.created_at, event_id=last.id)
        encoded = self._encoded.get(limit)
        if encoded is None:
            # The outcome's canonical form (contract _envelopes._dumps) up to its messages.
            body = json.dumps([e.to_json_obj() for e in messages], separators=(",", ":"),
                              ensure_ascii=False, allow_nan=False)
            encoded = self._encoded[limit] = b'{"messages":' + body.encode("utf-8")
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

    Args:
        pool: whose connections carry the windows' live subscriptions.
        max_bytes: the windows' estimated bytes together (0: no windows at all).
        depth: events a window keeps (reads with a larger limit go to the relay).
        max_age: seconds after which a window is refilled from the relay.
        idle_seconds: a window not served this long is closed (checked on each read).
    """

    def __init__(self, pool: RelayPool, *, max_bytes: int = DEFAULT_WINDOW_BYTES,
                 depth: int = 100, max_age: float = 60.0, idle_seconds: float = 300.0) -> None:
        if max_bytes < 0 or depth < 1 or max_age <= 0 or idle_seconds <= 0:
            raise ValueError("WindowCache needs max_bytes >= 0, depth >= 1 and positive ages")
        self._pool = pool
        self.max_bytes = max_bytes
        self.depth = depth
        self._max_age = max_age
        self._idle = idle_seconds
        self._windows: OrderedDict[WindowKey, Window] = OrderedDict()
        self._served_at: dict[WindowKey, float] = {}
        self._opening: set[WindowKey] = set()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._windows)

    def get(self, key: WindowKey) -> Window | None:
        """The key's window if it is kept and fresh; marks it most recently used."""
        now = trio.current_time()
        while self._windows:
            oldest_key, oldest = next(iter(self._windows.items()))
            if now - self._served_at.get(oldest_key, now) < self._idle:
                break
            oldest.end("idle")
        window = self._windows.get(key)
        if window is None:
            return None
        if now - window.filled_at >= self._max_age:
            window.end("refresh")
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
        window = Window(self, key, accept, self.depth, max_page_bytes, size_of)
        self._opening.add(key)
        try:
            try:
                window.subscription = await self._pool.subscribe(
                    key.agent, self._live_filters(key, filters), window)
            except RelayError as exc:
                # Subscriptions full, refused or unavailable: the plain read answers (and
                # reports the relay's failure itself, as it always did).
                log_event(_log, "read.window_not_opened", agent=key.agent,
                          channel_id=key.channel_id, reason=type(exc).__name__)
                window.valid = False
                return await read(), None
            try:
                page = await read()
            except BaseException:
                window.end("cold read failed")
                raise
            if not window.fill(page):
                window.end("not kept")
                return page, None
            window.filled_at = trio.current_time()
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
        old = self._windows.pop(window.key, None)
        if old is not None and old is not window:
            self.bytes -= old.cost
            old.end("replaced")
        self._windows[window.key] = window
        self._served_at[window.key] = trio.current_time()
        self.bytes += window.cost
        self._evict()

    def resized(self, window: Window, delta: int) -> None:
        """A kept window's cost changed by `delta`: evict past the bound."""
        if self._windows.get(window.key) is not window:
            return
        self.bytes += delta
        self._evict()

    def _evict(self) -> None:
        while self.bytes > self.max_bytes and self._windows:
            _, oldest = next(iter(self._windows.items()))
            oldest.end("evicted (read_window_bytes)")

    def forget(self, window: Window) -> None:
        if self._windows.get(window.key) is window:
            del self._windows[window.key]
            self._served_at.pop(window.key, None)
            self.bytes -= window.cost

    def close(self) -> None:
        """End every window (the daemon is stopping)."""
        for window in list(self._windows.values()):
            window.end("closing")
