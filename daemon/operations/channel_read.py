"""channel.read: one page of a channel, a thread, or the requester's mentions, newest first.

On the relay (buzz-on-the-relay.md "The nine operations", "Channels", "Reading"): a REQ
authenticated as the requester, `kinds` = READ_KINDS, `#h` = [channel]; `#p` = [requester]
for mentionsOnly; for a thread, the union of `#e` = [root] (the replies) and `ids` =
[root] (the root itself). Paging and cursors: daemon/relay/paging.py and daemon/relay/cursor.py.

Decisions (each documented here because Buzz leaves them to the host):

* Kinds 9 and 40002 only, as the issue states. Buzz clients also read 40008, 45001 and
  45003, but the contract calls the page "messages" and says nothing of those kinds'
  meaning; adding one is one edit of READ_KINDS (and then its tag rules, if any). The
  same table says what a reply or a reaction may build on (`_events.fetch_in_channel`):
  a parent, root or target channel.read would never show is refused.
* A thread read includes its root. A Buzz thread is shown as the root plus the events
  tagging it; a page of replies without the message they answer would make every agent
  issue a second lookup. The root must itself pass every other narrowing (channel, kind,
  and mentionsOnly if asked): the filters are the same, only `#e` becomes `ids`.
* A thread is ancestry, not citation. `#e` = [root] is what the relay can filter on, and
  it also returns events that merely cite the root: a `mention`-marked `e` tag, a reply
  in another thread naming it, a positional (unmarked) tag. Each event the relay sends is
  kept only if it is the root or the root its signed tags declare is this one
  (`buzzwire.threads.in_thread`, on the rule message.reply reads a parent's thread by); the rest
  are dropped as `off_thread` (NIP-BA: "All returned messages MUST satisfy the requested
  channel/thread/mention filters. Ancestry and mentions come from signed tags"). A root
  that is itself a reply reads as that event alone (plus any event declaring it its
  root): its replies name the outer root, so they are that thread's, not this one's.
* Relay unreachable, dropped, or no EOSE -> `failed` + `action_failed`; a CLOSED
  `restricted:` or a refused AUTH -> `failed` + `action_failed` too. A read has no side
  effects, so `failed` ("nothing happened") is always the honest fate, and a retry is the
  agent's call. The relay's reason goes to the operator log only.
* A cursor that fails for any reason (forged, truncated, foreign principal / channel /
  filter, expired, another host's key) -> `failed` + `invalid_request` with one fixed
  message: no oracle for which check failed.
* A page is held to MAX_PAGE_BYTES (the contract's `page_bytes`: the events' content and
  tags, plus a fixed allowance per event for the other members): past it the page ends
  early with a `nextCursor`, which the contract allows (a page is at most `limit`, and
  `nextCursor` says more exists). So one read answer - and the read verdict the ledger
  stores - stays bounded whatever the relay holds; the relay's reply itself is bounded by
  `daemon.relay.pool.MAX_QUERY_BYTES`. The agent client bounds the JSON values of an
  answer by what such a page holds (contract `MAX_PAGE_VALUES`), so both the bound and
  its count live in the contract, not here.
* An event is not refused for how many tags it has: Buzz's own client shows a message of
  2,000 tags, and the page's byte bound already bounds its values (each tag value is
  charged 20 bytes beyond its own, contract `_page`: such pages end sooner, with a
  `nextCursor`).
* Every event the relay sends is checked before it is delivered: exactly the seven
  canonical members (contract `Event`), a valid id and BIP-340 signature, then in the
  order of `_CHECKS` no empty tag (NIP-01; Buzz's SDK refuses a page holding one), a
  content of at most MAX_CONTENT_BYTES (NIP-BA's post bound, UTF-8 bytes) and at most
  MAX_ENCODED_EVENT_BYTES of JSON as sent (Buzz's SDK refuses a page holding a larger
  one too; NIP-BA bounds only what a host publishes, so any member can put one on the
  relay), the channel's `h` tag and no other `h` tag, a match with the
  filter asked, and on a thread read its declared root. A failing event is dropped and
  logged (event id and the check's name; no content; `ReadLog`) and never counted in the
  page. The first two are shared process-wide (`_JudgedCache`): a fleet's agents each
  receive the same event on their own connections, and an exact copy of an event already
  judged is not judged again.
* A relay that sends a read more than MAX_FORGED_EVENTS events whose id or signature does
  not verify is misbehaving: the read stops there, `failed` + `action_failed`
  (`read.relay_garbled`, reason `forged_events`). An honest relay verifies what it stores
  (NIP-01), so these are never a channel's own; a forged event is never cached, so without
  the bound one read of a relay filling every reply with them cost MAX_ROUNDS x
  pool.MAX_EVENTS_PER_QUERY (40,000) signature checks. The few below it are dropped as
  above, so a relay holding a stray corrupt event still serves the channel.

* A read with no thread root and a limit up to the window depth (Buzz's poll: limit 100)
  is answered from the requester's read window for that channel when the relay pool
  keeps windows (daemon/relay/windows.py): the same page a cold read returns, kept true
  by a live subscription under the requester's own AUTH. The first read without a cursor
  opens the window with an ordinary cold read; a cursor read inside the window is
  answered from it, one that continues from its bottom is read from the relay and kept
  by the window; reads with a thread or a larger limit always go to the relay, as before.

* What a read logs goes through the daemon's one `ReadLog` (`Context.read_log`): one line
  a minute per event and cause, then a count. A relay that is down, refuses, garbles or
  sends bad events does so to every poll of a fleet (256 reads a second), and a cursor
  an agent forges is refused as often as it likes: a line each was a flood of the
  journal (the same reason as the verdict lines', daemon/pipeline/recorder.py). A relay
  failure's line is kept apart by the exception and the NIP-01 prefix of the relay's
  message (`restricted`, `auth-required`, ...; `_relay_cause`), never by the message
  itself: a relay that words each refusal anew would otherwise get a line for each, and
  the reason the line carries is cut where the pool took it (`quote_reason`).

WARNING: the filters built by `_base_filters` may only use the members
`daemon.relay.paging.matches` implements.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from buzzwire import kinds
from buzzwire.nostr import verify_event
from buzzwire.threads import in_channel, in_thread
from buzzwire.contract import (
    MAX_CONTENT_BYTES,
    MAX_ENCODED_EVENT_BYTES,
    MAX_PAGE_BYTES,
    ChannelReadArgs,
    ContractError,
    ErrorCode,
    Event,
    ReadOutcome,
    Status,
    Verdict,
    page_bytes,
)
from daemon.relay.cursor import CursorScope, InvalidCursor, Position
from daemon.fault_log import FaultLogs
from daemon.operations._base import Context
from daemon.relay.paging import RELAY_MAX_LIMIT, Page, RelayMisbehaved, matches, read_page
from daemon.relay.pool import RelayError, RelayRefused, RelayUnavailable, decoded_size
from daemon.relay.protocol import machine_prefix
from daemon.relay.windows import Served, WindowCache, WindowKey, encode_event

__all__ = ["ACTION", "DROP_LINES", "JUDGED_CACHE_BYTES", "JudgedCache", "MAX_FORGED_EVENTS",
           "MAX_PAGE_BYTES", "READ_KINDS", "ReadLog", "execute"]

ACTION = "channel.read"
#: Channel message kinds read (buzz-on-the-relay.md "Channels": 9 stream message,
#: 40002 stream message v2). See the module docstring for the kinds left out.
READ_KINDS: tuple[int, ...] = (kinds.STREAM_MESSAGE, kinds.STREAM_MESSAGE_V2)

_log = logging.getLogger("buzz_broker.read")

#: Events a due read window is confirmed by (its newest, read afresh from the relay under
#: the agent's AUTH; daemon/relay/windows.py "Kept true"). A few, not a page: measured on
#: the fleet at full size, re-reading 256 windows' pages within seconds stalled
#: LocalRelay (answers of 10-28 s); a relay that no longer serves the agent answers none.
CONFIRM_EVENTS = 5
#: Fixed agent-facing messages (style.md rule 12): never built from an exception's text.
_BAD_CURSOR = "the cursor is not valid for this read; start again without one"
_RELAY_DOWN = "the relay could not be read; nothing happened, the read may be retried"
_RELAY_REFUSED = "the relay refused the read"
#: `RelayMisbehaved.reason` -> what the agent is told.
_RELAY_GARBLED: Mapping[str, str] = {
    "no_boundary": "the relay answered with data that cannot be paged",
    "forged_events": "the relay answered with events whose signatures do not verify",
}
#: Events failing the id or signature check one read drops before it stops (module doc).
MAX_FORGED_EVENTS = 16


def _base_filters(args: ChannelReadArgs, requester: str) -> list[dict[str, object]]:
    """The NIP-01 filters of this read, without since/until/limit (paging adds those)."""
    base: dict[str, object] = {"kinds": list(READ_KINDS), "#h": [args.channel_id]}
    if args.mentions_only:
        base["#p"] = [requester]
    if args.root_event_id is None:
        return [base]
    return [{**base, "#e": [args.root_event_id]}, {**base, "ids": [args.root_event_id]}]


#: Causes each event of `ReadLog` keeps apart (a dropped event's check, a relay failure's
#: prefix: `_relay_cause`); past them, one line a minute for the rest (`FaultLog`'s "other").
DROP_LINES = 16

#: What reads log, at what level: every line a read writes is one of these.
_LINES: Mapping[str, int] = {
    "read.event_dropped": logging.WARNING,
    "read.relay_unavailable": logging.WARNING,
    "read.relay_refused": logging.WARNING,
    "read.relay_garbled": logging.WARNING,
    "read.second_overflow": logging.WARNING,
    "read.malformed_items": logging.WARNING,
    "read.page_cut": logging.INFO,
    "read.cursor_refused": logging.INFO,
}


class ReadLog(FaultLogs):
    """The daemon's lines about reads (module docstring): per event of `_LINES`, one line
    a minute per cause, the next carrying how many were not shown. One per daemon."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(_log, _LINES, max_causes=DROP_LINES)


class _Judge:
    """Decides whether one relay item may be delivered; logs its drops (`ReadLog`): a
    relay sends as many bad events as it likes, to every read and every window.

    `max_forged`: past this many items failing the id or signature check, raise
    RelayMisbehaved("forged_events") (module doc). None never raises: a window's live
    judge runs in the connection's reader task, which must not raise; what a window
    judges is bounded there (daemon/relay/windows.py `Window.event`).

    `root_event_id`: the thread read (its events must be in it, `in_thread`), or None.
    """

    __slots__ = ("channel_id", "filters", "root_event_id", "request_id", "_drops", "_judged",
                 "_forged_left")

    def __init__(self, channel_id: str, filters: Sequence[Mapping[str, object]],
                 request_id: str, drops: ReadLog, judged: JudgedCache, *,
                 max_forged: int | None = None, root_event_id: str | None = None) -> None:
        self.channel_id = channel_id
        self.filters = filters
        self.root_event_id = root_event_id
        self.request_id = request_id
        self._drops = drops
        self._judged = judged
        self._forged_left = max_forged

    def __call__(self, item: Mapping[str, object]) -> Event | None:
        event = self._judged.known(item)
        if event is None:
            try:
                event = Event.from_json_obj(item)
            except (ContractError, TypeError, ValueError):
                self._drop(item, "not_canonical")
                return None
            if not _signature_ok(self, item, event):
                self._drop(item, "bad_signature")
                if self._forged_left is not None:
                    if self._forged_left == 0:
                        raise RelayMisbehaved("forged_events")
                    self._forged_left -= 1
                return None
            self._judged.remember(event)
        for name, check in _CHECKS:
            if not check(self, item, event):
                self._drop(item, name)
                return None
        return event

    def _drop(self, item: Mapping[str, object], reason: str) -> None:
        event_id = item.get("id")
        # Public identifier only, and only when it looks like one (no relay text echoed).
        shown = event_id if isinstance(event_id, str) and len(event_id) == 64 else None
        self._drops.record("read.event_dropped", reason, request_id=self.request_id,
                           reason=reason, event_id=shown)


#: The estimated bytes `JudgedCache` holds (each entry's objects, `_judged_cost`).
JUDGED_CACHE_BYTES = 16 * 1024 * 1024
#: What one cached judgement adds to its objects (the entry's tuple, its OrderedDict slot).
_JUDGED_OVERHEAD = 400


def _judged_cost(obj: Mapping[str, object]) -> int:
    """Bytes one entry holds, over-counted: its JSON members as objects, twice (the dict
    and the `Event`'s tuples beside it). Not the page's `page_bytes`, which counts a tag
    value's characters: an event of 80,000 one-letter tags is 0.5 MB of JSON but over
    10 MB of objects, and a relay may send as many such events as it likes."""
    return 2 * decoded_size(obj) + _JUDGED_OVERHEAD


class JudgedCache:
    """A bounded LRU of (event id, signature) -> the event as first judged canonical and
    verified, with its exact JSON members. One per daemon (`Context.judged`).

    Why: every agent of a fleet reads the same channels under its own AUTH, so the same
    event arrives once per agent (a live subscription each, and each cold read); the
    shape parse, id hash and signature check were paid per copy. Only judging is shared:
    what each agent sees is still what its own relay connection delivered.

    Why it is safe: a hit requires the item to equal, member for member, the JSON of an
    event already proven canonical, with an id that hashes its members and a BIP-340
    signature over that id (JSON equality with `created_at` and `kind` exactly ints, so
    no `1.0` or `true` passes for `1`). An item that differs in anything, as a relay
    serving the same id and signature over other content, is judged afresh from scratch.
    """

    def __init__(self, max_bytes: int) -> None:
        self._max = max_bytes
        self._bytes = 0
        self._entries: OrderedDict[tuple[str, str], tuple[dict[str, object], Event, int]] = OrderedDict()

    def known(self, item: Mapping[str, object]) -> Event | None:
        """The judged event `item` is an exact copy of, or None."""
        event_id, sig = item.get("id"), item.get("sig")
        if type(event_id) is not str or type(sig) is not str:
            return None  # judged afresh (and dropped): not even a key to look up
        entry = self._entries.get((event_id, sig))
        if entry is None:
            return None
        obj, event, _cost = entry
        if (type(item.get("created_at")) is not int or type(item.get("kind")) is not int
                or item != obj):
            return None
        self._entries.move_to_end((event_id, sig))
        return event

    def remember(self, event: Event) -> None:
        key = (event.id, event.sig)
        if key in self._entries:
            return
        obj = event.to_json_obj()
        cost = _judged_cost(obj)
        self._entries[key] = (obj, event, cost)
        self._bytes += cost
        while self._bytes > self._max and self._entries:
            _, (_, _, dropped) = self._entries.popitem(last=False)
            self._bytes -= dropped


def _signature_ok(judge: _Judge, item: Mapping[str, object], event: Event) -> bool:
    # verify_event recomputes the id from the item's own members, then checks BIP-340.
    return verify_event(item) is True


def _tags_ok(judge: _Judge, item: Mapping[str, object], event: Event) -> bool:
    # NIP-01: a tag holds one or more strings. The wire contract lets `[]` through, but
    # Buzz's SDK (rust-nostr) refuses such an event, and with it the whole page: one
    # member's event would stop every agent reading the channel. The contract's
    # MAX_PAGE_VALUES, which the agent client reads answers by, counts on it too: an empty
    # tag is two JSON values for no bytes of `page_bytes`.
    return all(event.tags)


def _size_ok(judge: _Judge, item: Mapping[str, object], event: Event) -> bool:
    # Buzz's SDK refuses a whole read answer holding one message whose content is past
    # NIP-BA's post bound (UTF-8 bytes) or whose JSON as sent is past
    # MAX_ENCODED_EVENT_BYTES. NIP-BA bounds only what a host publishes, so any member can
    # put a larger event on the relay, and every agent polling the channel would read
    # nothing until 100 newer messages pushed it out. Encoding a Buzz message costs
    # ~0.2 ms, every event of every cold read: only one whose cheap bound is past the
    # limit is encoded.
    return (_content_fits(event.content)
            and (_json_bytes_at_most(event) <= MAX_ENCODED_EVENT_BYTES
                 or len(encode_event(event)) <= MAX_ENCODED_EVENT_BYTES))


def _content_fits(content: str) -> bool:
    # A character is one to four UTF-8 bytes: only a content between the two is encoded.
    if len(content) <= MAX_CONTENT_BYTES // 4:
        return True
    return len(content) <= MAX_CONTENT_BYTES and len(content.encode("utf-8")) <= MAX_CONTENT_BYTES


#: The most JSON bytes one character of a string takes as sent (`\u0001`; a character
#: written verbatim is at most four UTF-8 bytes).
_JSON_BYTES_PER_CHAR = 6
#: The most an event's JSON holds beyond its strings' characters and their punctuation:
#: member names, ids, signature and braces are 333 bytes with one-digit numbers (contract
#: `_page`), and created_at and kind are at most 20 characters each.
_EVENT_JSON_FRAME = 400
#: A tag's `[`, `]` and the `,` after it; a tag value's two quotes and the `,` after it.
_TAG_JSON_BYTES = 3
_TAG_VALUE_JSON_BYTES = 3


def _json_bytes_at_most(event: Event) -> int:
    """Bytes `encode_event(event)` cannot exceed, without encoding it."""
    chars = len(event.content)
    values = 0
    for tag in event.tags:
        values += len(tag)
        chars += sum(map(len, tag))
    return (_EVENT_JSON_FRAME + _JSON_BYTES_PER_CHAR * chars
            + _TAG_JSON_BYTES * len(event.tags) + _TAG_VALUE_JSON_BYTES * values)


def _channel_ok(judge: _Judge, item: Mapping[str, object], event: Event) -> bool:
    return in_channel(event.tags, judge.channel_id)


def _filter_ok(judge: _Judge, item: Mapping[str, object], event: Event) -> bool:
    return any(matches(item, flt) for flt in judge.filters)


def _thread_ok(judge: _Judge, item: Mapping[str, object], event: Event) -> bool:
    # `#e` only says the event names the root somewhere; ancestry is the declared root
    # (module doc, "A thread is ancestry, not citation").
    return judge.root_event_id is None or in_thread(event.id, event.tags, judge.root_event_id)


#: The checks after the canonical-shape parse, in order; the name is what the log says.
#: The shape and "bad_signature" come first, in `_Judge.__call__` (shared: `_JudgedCache`).
_CHECKS: tuple[tuple[str, Callable[[_Judge, Mapping[str, object], Event], bool]], ...] = (
    ("empty_tag", _tags_ok),
    ("oversized", _size_ok),
    ("wrong_channel", _channel_ok),
    ("off_filter", _filter_ok),
    ("off_thread", _thread_ok),
)


async def execute(ctx: Context, args: ChannelReadArgs) -> Verdict:
    """Read one page. Returns `succeeded` with a ReadOutcome, or `failed` (see module doc)."""
    requester = ctx.principal.agent
    scope = CursorScope(
        agent=requester,
        channel_id=args.channel_id,
        mentions_only=args.mentions_only,
        root_event_id=args.root_event_id,
    )
    now = ctx.now()
    after = None
    if args.cursor is not None:
        try:
            after = ctx.cursors.decode(args.cursor, scope, now=now)
        except InvalidCursor:
            ctx.read_log.record("read.cursor_refused", request_id=ctx.request_id)
            return Verdict.failed(ErrorCode.INVALID_REQUEST, _BAD_CURSOR)

    filters = _base_filters(args, requester)
    judge = _Judge(args.channel_id, filters, ctx.request_id, ctx.read_log, ctx.judged,
                   max_forged=MAX_FORGED_EVENTS, root_event_id=args.root_event_id)
    limit = min(args.effective_limit, RELAY_MAX_LIMIT)

    async def query(batch: list[dict[str, object]]) -> list[dict[str, object]]:
        return await ctx.relay.query(requester, batch)

    async def cold(limit: int = limit, after: Position | None = after) -> Page[Event]:
        return await read_page(
            query,
            filters,
            after=after,
            limit=limit,
            accept=judge,
            cap=RELAY_MAX_LIMIT,
            max_bytes=MAX_PAGE_BYTES,
            size_of=page_bytes,
        )

    # getattr: a stand-in for the pool (tests, benchmarks) may have no windows at all.
    windows: WindowCache | None = getattr(ctx.relay, "windows", None)
    try:
        if windows is not None and args.root_event_id is None and limit <= windows.depth:
            key = WindowKey(agent=requester, channel_id=args.channel_id,
                            mentions_only=args.mentions_only)
            window = windows.get(key)
            if window is not None and windows.due(window):
                # Checked against the relay (daemon/relay/windows.py "Kept true"): the
                # newest events afresh, whatever this read's cursor; the window stays only
                # if they are the window's own.
                window.begin_check()
                if window.confirms(await cold(CONFIRM_EVENTS, None)):
                    windows.renew(window)
                else:
                    window.end("refresh")
                    window = None
            served = window.serve(limit, after) if window is not None else None
            if served is not None:
                return _served(ctx, served, scope, now)
            if after is not None or window is not None:
                # A continuation below the window's bottom (Buzz's runtime follows
                # nextCursor back through the channel): read it, and let the window keep
                # it when it continues exactly from the window's last event.
                mark = window.continuation(after) if window is not None and after is not None else None
                page = await cold()
                if mark is not None and window is not None:
                    window.extend(mark, page)
            else:
                # A window holds `depth` events whatever this read's limit; its own judge
                # logs its live drops under no one request.
                depth = windows.depth
                page, window = await windows.open(
                    key, filters,
                    _Judge(args.channel_id, filters, "window", ctx.read_log, ctx.judged,
                           max_forged=None),
                    lambda: cold(depth), max_page_bytes=MAX_PAGE_BYTES, size_of=page_bytes)
                served = window.serve(limit) if window is not None else None
                if served is not None:
                    return _served(ctx, served, scope, now)
                page = _first(page, limit)
        else:
            page = await cold()
    except RelayUnavailable as exc:
        ctx.read_log.record("read.relay_unavailable", _relay_cause(exc),
                            request_id=ctx.request_id, reason=exc.reason)
        return Verdict.failed(ErrorCode.ACTION_FAILED, _RELAY_DOWN)
    except RelayRefused as exc:
        ctx.read_log.record("read.relay_refused", _relay_cause(exc),
                            request_id=ctx.request_id, reason=exc.reason)
        return Verdict.failed(ErrorCode.ACTION_FAILED, _RELAY_REFUSED)
    except RelayMisbehaved as exc:
        ctx.read_log.record("read.relay_garbled", exc.reason, request_id=ctx.request_id,
                            reason=exc.reason)
        return Verdict.failed(ErrorCode.ACTION_FAILED, _RELAY_GARBLED[exc.reason])

    for second in page.overflow_seconds:
        # design.md: the one case paging cannot make exact — say so.
        ctx.read_log.record("read.second_overflow", request_id=ctx.request_id,
                            created_at=second, relay_cap=RELAY_MAX_LIMIT)
    if page.cut_by_bytes:
        ctx.read_log.record("read.page_cut", request_id=ctx.request_id,
                            items=len(page.items), max_bytes=MAX_PAGE_BYTES)
    if page.malformed:
        ctx.read_log.record("read.malformed_items", request_id=ctx.request_id,
                            count=page.malformed)
    next_cursor = None
    if page.next_position is not None:
        next_cursor = ctx.cursors.encode(page.next_position, scope, now=now)
    return Verdict.succeeded(ACTION, ReadOutcome(messages=page.items, next_cursor=next_cursor))


def _relay_cause(exc: RelayError) -> str:
    """What a relay failure's read line is kept apart by (module docstring): the NIP-01
    prefix of its reason (a CLOSED's message leads it), or "none" when it has no prefix
    we know. One of a dozen words, whatever text the relay chose."""
    prefix = machine_prefix(exc.reason)
    return "none" if prefix is None else prefix.value


def _first(page: Page[Event], limit: int) -> Page[Event]:
    """The first `limit` events of a deeper page: what a read with `limit` returns (the
    order is the same, and a byte cut falls where it would)."""
    if len(page.items) <= limit:
        return page
    last = page.items[limit - 1]
    return replace(page, items=page.items[:limit],
                   next_position=Position(created_at=last.created_at, event_id=last.id),
                   cut_by_bytes=False)


def _served(ctx: Context, served: Served, scope: CursorScope, now: int) -> Verdict:
    """A read answered from a window: its page, its cursor (fresh: it carries the time),
    and the outcome's bytes from the window's encoded messages (contract `Verdict`)."""
    next_cursor = None
    encoded = served.encoded_messages
    if served.next_position is not None:
        next_cursor = ctx.cursors.encode(served.next_position, scope, now=now)
        encoded += b',"nextCursor":' + json.dumps(next_cursor).encode("ascii")
    return Verdict(status=Status.SUCCEEDED, action=ACTION,
                   outcome=ReadOutcome(messages=served.messages, next_cursor=next_cursor),
                   encoded_outcome=encoded + b"}")
