"""paging.read_page against a relay that cuts inside seconds: every event exactly once, in order."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daemon.relay.cursor import Position
from daemon.relay.paging import (
    MAX_ROUNDS,
    RELAY_MAX_LIMIT,
    Page,
    RelayMisbehaved,
    matches,
    order_key,
    read_page,
)
from daemon.relay.pool import AnswerTooLarge
from tests.read.fake_relay import FakeRelay

CHANNEL = "0b7b2f0e-1c5e-4f6a-9d3c-2a1b0c9d8e7f"
ME = "a" * 64
ROOT = "e" * 64
BASE = {"kinds": [9, 40002], "#h": [CHANNEL]}


def make_event(n: int, created_at: int, *, mention: bool = False, reply: bool = False, kind: int = 9) -> dict[str, object]:
    tags: list[list[str]] = [["h", CHANNEL]]
    if reply:
        tags.append(["e", ROOT, "", "root"])
    if mention:
        tags.append(["p", ME])
    return {
        "id": hashlib.sha256(n.to_bytes(8, "big")).hexdigest(),
        "pubkey": "b" * 64,
        "created_at": created_at,
        "kind": kind,
        "tags": tags,
        "content": f"m{n}",
        "sig": "c" * 128,
    }


def declared_order(events: Sequence[Mapping[str, object]]) -> list[str]:
    ordered = sorted(events, key=lambda ev: order_key(int(ev["created_at"]), str(ev["id"])))  # type: ignore[call-overload]
    return [str(ev["id"]) for ev in ordered]


def keep(item: Mapping[str, object]) -> Mapping[str, object] | None:
    return item


async def read_all(relay: FakeRelay, bases: Sequence[Mapping[str, object]], limit: int, cap: int, max_pages: int = 2000) -> tuple[list[str], list[Page[Mapping[str, object]]]]:
    ids: list[str] = []
    pages: list[Page[Mapping[str, object]]] = []
    after: Position | None = None
    for _ in range(max_pages):
        page = await read_page(relay.query, bases, after=after, limit=limit, accept=keep, cap=cap)
        assert len(page.items) <= limit
        pages.append(page)
        ids.extend(str(item["id"]) for item in page.items)
        if page.next_position is None:
            return ids, pages
        after = page.next_position
    raise AssertionError("paging did not end")


# Seconds drawn from a tiny range so that many events share one second.
event_specs = st.lists(
    st.tuples(st.integers(0, 6), st.booleans(), st.booleans(), st.sampled_from([9, 40002, 7])),
    max_size=120,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=event_specs, limit=st.integers(1, 25), seed=st.integers(0, 2**32), scope=st.sampled_from(["all", "mentions", "thread"]))
def test_every_event_once_in_order(specs: list[tuple[int, bool, bool, int]], limit: int, seed: int, scope: str) -> None:
    cap = 64  # above the largest second (120 events over 7 seconds can exceed it rarely; see assume)
    events = [make_event(n, 1_700_000_000 + t, mention=m, reply=r, kind=k) for n, (t, m, r, k) in enumerate(specs)]
    if scope == "all":
        bases: list[Mapping[str, object]] = [BASE]
    elif scope == "mentions":
        bases = [{**BASE, "#p": [ME]}]
    else:
        root = make_event(10_000, 1_700_000_000 + 3)
        root["id"] = ROOT
        events.append(root)
        bases = [{**BASE, "#e": [ROOT]}, {**BASE, "ids": [ROOT]}]
    expected = declared_order([ev for ev in events if any(matches(ev, b) for b in bases)])
    per_second = max((sum(1 for ev in events if ev["created_at"] == s) for s in {e["created_at"] for e in events}), default=0)
    assert per_second < cap
    relay = FakeRelay(events, cap=cap, seed=seed)
    ids, pages = trio.run(read_all, relay, bases, limit, cap)
    assert ids == expected
    # nextCursor only when more exists: the last page has none, every other page is full.
    assert pages[-1].next_position is None
    assert all(len(p.items) == limit for p in pages[:-1])
    assert all(p.overflow_seconds == () for p in pages)


async def test_three_hundred_in_one_second_at_the_real_cap() -> None:
    events = [make_event(n, 1_700_000_000 + (n % 40 if n >= 300 else 500)) for n in range(1000)]
    for limit in (7, 500, 1, 100):
        relay = FakeRelay(events, cap=500, seed=limit)
        ids, pages = await read_all(relay, [BASE], limit, 500)
        assert ids == declared_order(events)
        assert len(ids) == len(set(ids)) == 1000
        # A page costs at most three round trips here (sweep+main, then boundary sweep).
        assert max(p.rounds for p in pages) <= 3


async def test_sparse_channel_pages_in_one_round_trip() -> None:
    events = [make_event(n, 1_700_000_000 + n) for n in range(50)]
    relay = FakeRelay(events, cap=500, seed=1)
    ids, pages = await read_all(relay, [BASE], 10, 500)
    assert ids == declared_order(events)
    assert [p.rounds for p in pages] == [1] * len(pages)


async def test_empty_channel_has_no_cursor() -> None:
    page = await read_page(FakeRelay([], cap=500, seed=0).query, [BASE], after=None, limit=5, accept=keep)
    assert page.items == () and page.next_position is None


async def test_exact_multiple_has_no_dangling_cursor() -> None:
    events = [make_event(n, 1_700_000_000 + n // 3) for n in range(20)]
    ids, pages = await read_all(FakeRelay(events, cap=500, seed=3), [BASE], 10, 500)
    assert len(pages) == 2 and pages[-1].next_position is None and ids == declared_order(events)


async def test_second_over_the_cap_is_detected() -> None:
    cap = 10
    events = [make_event(n, 1_700_000_000) for n in range(25)] + [make_event(100 + n, 1_699_999_999) for n in range(3)]
    relay = FakeRelay(events, cap=cap, seed=9)
    ids, pages = await read_all(relay, [BASE], 5, cap)
    assert any(p.overflow_seconds == (1_700_000_000,) for p in pages)
    # What can be seen is still delivered at most once, in order, and the older second whole.
    assert len(ids) == len(set(ids))
    assert ids == [i for i in declared_order(events) if i in set(ids)]
    assert set(declared_order(events[25:])) <= set(ids)


async def test_rejected_events_are_skipped_not_counted() -> None:
    events = [make_event(n, 1_700_000_000 + n // 4) for n in range(40)]
    bad = {str(ev["id"]) for ev in events[::3]}

    def accept(item: Mapping[str, object]) -> Mapping[str, object] | None:
        return None if item["id"] in bad else item

    after: Position | None = None
    got: list[str] = []
    relay = FakeRelay(events, cap=500, seed=5)
    for _ in range(100):
        page = await read_page(relay.query, [BASE], after=after, limit=4, accept=accept)
        got.extend(str(i["id"]) for i in page.items)
        if page.next_position is None:
            break
        assert len(page.items) == 4
        after = page.next_position
    assert got == [i for i in declared_order(events) if i not in bad]


async def test_malformed_items_never_cause_a_skip() -> None:
    events = [make_event(n, 1_700_000_000 + n // 5) for n in range(30)]
    inner = FakeRelay(events, cap=500, seed=2)

    async def noisy(filters: list[dict[str, object]]) -> list[object]:
        reply = await inner.query(filters)
        return [*reply, "junk", {"id": "zz", "created_at": 5}, {"id": "1" * 64, "created_at": 2_000_000_000}]

    after: Position | None = None
    got: list[str] = []
    for _ in range(100):
        page = await read_page(noisy, [BASE], after=after, limit=6, accept=lambda item: item)
        got.extend(str(i["id"]) for i in page.items if i["id"] != "1" * 64)
        assert page.malformed >= 3
        if page.next_position is None:
            break
        after = page.next_position
    assert got == declared_order(events)


async def test_relay_that_fills_its_limit_with_garbage() -> None:
    async def garbage(filters: list[dict[str, object]]) -> list[object]:
        return ["x"] * 50

    with pytest.raises(RelayMisbehaved):
        await read_page(garbage, [BASE], after=None, limit=5, accept=keep)


@pytest.mark.parametrize("limit", [5, 1])
async def test_round_bound_returns_an_exact_resumable_page(limit: int) -> None:
    # Four events per second: the first reply is cut inside its oldest second, so a second
    # round is needed; with the bound at one round the page stops early (limit 5: four
    # events and their position; limit 1: nothing yet, a position before the whole cut
    # second) and resuming from it is exact.
    events = [make_event(n, 1_700_000_000 - n // 4) for n in range(40)]
    relay = FakeRelay(events, cap=500, seed=4)
    page = await read_page(relay.query, [BASE], after=None, limit=limit, accept=keep, max_rounds=1)
    assert page.rounds == 1 and page.next_position is not None
    assert len(page.items) < limit
    first = [str(i["id"]) for i in page.items]
    rest, _ = await read_all_from(relay, page.next_position, 7)
    assert first + rest == declared_order(events)


async def read_all_from(relay: FakeRelay, after: Position, limit: int) -> tuple[list[str], int]:
    ids: list[str] = []
    for pages in range(1, 100):
        page = await read_page(relay.query, [BASE], after=after, limit=limit, accept=keep)
        ids.extend(str(i["id"]) for i in page.items)
        if page.next_position is None:
            return ids, pages
        after = page.next_position
    raise AssertionError("paging did not end")


def test_limit_out_of_range_is_our_bug() -> None:
    with pytest.raises(ValueError):
        trio.run(lambda: read_page(FakeRelay([], cap=5, seed=0).query, [BASE], after=None, limit=0, accept=keep))


class _SmallIdsLast(FakeRelay):
    """A relay that cuts inside a second at the worst place for the reader: ties are
    sent largest id first, so a reply cut inside a second lacks that second's smallest
    ids (the first ones in the declared order)."""

    async def query(self, filters: list[dict[str, object]]) -> list[object]:
        self.requests.append(filters)
        reply: list[object] = []
        for flt in filters:
            hits = [ev for ev in self.events if matches(ev, flt)]
            hits.sort(key=lambda ev: (-int(ev["created_at"]), [-ord(c) for c in str(ev["id"])]))  # type: ignore[call-overload]
            limit = flt.get("limit", self.cap)
            assert isinstance(limit, int)
            reply.extend(hits[: min(limit, self.cap)])
        return reply


async def _read_all(query, limit: int) -> list[str]:  # type: ignore[no-untyped-def]
    ids: list[str] = []
    after: Position | None = None
    for _ in range(100):
        page = await read_page(query, [BASE], after=after, limit=limit, accept=keep)
        ids.extend(str(i["id"]) for i in page.items)
        if page.next_position is None:
            return ids
        after = page.next_position
    raise AssertionError("paging did not end")


@pytest.mark.parametrize("bad", [{"created_at": True}, {"created_at": -1}, {"created_at": 1.5},
                                 {"created_at": "1"}, {"id": "ab"}, {"id": "Z" * 64},
                                 {"id": "AB" * 32}], ids=repr)
async def test_an_item_without_a_usable_created_at_or_id_cannot_place_the_boundary(bad: dict[str, object]) -> None:
    # Five events a second; a page of 6 asks the main query for 8, so the reply is cut
    # inside its second-newest second (3 of its 5 events, the largest ids). One more item
    # that matches the filter but whose created_at is not an int in 0..MAX_CREATED_AT
    # (a bool, a negative, a float, a string), or whose id is not 64 lowercase hex, must
    # be counted as malformed, never placed:
    # placed, it is the "oldest" event of the reply and makes the cut second look
    # complete, so the two smallest ids of that second are never delivered.
    events = [make_event(n, 1_700_000_000 - n // 5) for n in range(20)]
    relay = _SmallIdsLast(events, cap=500, seed=0)
    bogus = {**make_event(999, 0), **bad}

    async def query(filters: list[dict[str, object]]) -> list[object]:
        return [*(await relay.query(filters)), bogus]

    assert await _read_all(query, 6) == declared_order(events)
    page = await read_page(query, [BASE], after=None, limit=6, accept=keep)
    assert page.malformed == page.rounds  # the bogus item, once per reply
    assert all(item is not bogus for item in page.items)


def test_matches_is_nip01_for_the_members_the_read_path_builds() -> None:
    # `matches` is both paging's attribution and channel_read's "off_filter" check (a
    # relay's event outside the read's filter is dropped), and the fake relay's oracle,
    # so the property tests above cannot see it change: its semantics are pinned here.
    event = {**make_event(1, 1_700_000_000, mention=True), "kind": 9}
    assert matches(event, BASE)
    assert matches(event, {**BASE, "#p": ["a" * 64]})
    # A bool is not a kind (True == 1 in Python).
    assert not matches({**event, "kind": True}, {"kinds": [1]})
    assert not matches({**event, "kind": False}, {"kinds": [0]})
    # A tag value matches only under its own letter.
    assert not matches(event, {**BASE, "#e": ["a" * 64]})
    assert not matches(event, {**BASE, "#h": ["another-channel"]})
    # A member whose wanted values are not a list matches nothing.
    assert not matches(event, {"kinds": 9})
    assert not matches(event, {"ids": str(event["id"])})
    # since/until are inclusive.
    assert matches(event, {"since": 1_700_000_000, "until": 1_700_000_000})
    assert not matches(event, {"since": 1_700_000_001})
    assert not matches(event, {"until": 1_699_999_999})
    # An unsupported member is our bug, never a silent match.
    for member in ("search", "#hh"):
        with pytest.raises(ValueError):
            matches(event, {member: ["x"]})


class _LooseKinds(FakeRelay):
    """A relay that does not apply `kinds` (a relay's matching is its own): its replies
    hold events no filter of the read matches, and its limits counted them."""

    async def query(self, filters: list[dict[str, object]]) -> list[object]:
        return await super().query([{k: v for k, v in f.items() if k != "kinds"} for f in filters])


async def test_items_no_filter_matches_still_count_against_the_limit() -> None:
    # Every other event is of a kind the read does not ask for; the relay counts them in
    # its limit anyway. Read as "complete" because too few of them match, a full reply
    # would end the channel early with no cursor: the rest would never be read.
    events = [make_event(n, 1_700_000_000 - n, kind=9 if n % 2 else 7) for n in range(30)]
    relay = _LooseKinds(events, cap=500, seed=1)

    def accept(item: Mapping[str, object]) -> Mapping[str, object] | None:
        return item if matches(item, BASE) else None  # as channel_read's "off_filter"

    ids: list[str] = []
    after: Position | None = None
    for _ in range(100):
        page = await read_page(relay.query, [BASE], after=after, limit=3, accept=accept)
        ids.extend(str(i["id"]) for i in page.items)
        if page.next_position is None:
            break
        after = page.next_position
    assert ids == declared_order([ev for ev in events if ev["kind"] == 9])


async def test_with_two_filters_the_newest_cut_bounds_what_is_complete() -> None:
    # A thread read has two filters, each cut by the relay on its own. Filter A's reply
    # (10 events in one second, 7 sent: the largest ids) is cut at that second; filter B's
    # (older, sparse) is cut far below. Only what is newer than the NEWEST cut is known
    # whole: taken down to B's cut, A's second would count as complete and its smallest
    # ids would never be read.
    t = 1_700_000_000
    events = [make_event(n, t) for n in range(10)] + [
        make_event(100 + n, t - 100 - n, kind=40002) for n in range(10)]
    relay = _SmallIdsLast(events, cap=500, seed=0)
    bases = [{"kinds": [9], "#h": [CHANNEL]}, {"kinds": [40002], "#h": [CHANNEL]}]
    ids: list[str] = []
    after: Position | None = None
    for _ in range(100):
        page = await read_page(relay.query, bases, after=after, limit=5, accept=keep)
        ids.extend(str(i["id"]) for i in page.items)
        if page.next_position is None:
            break
        after = page.next_position
    assert ids == declared_order(events)


async def test_an_event_the_relay_sends_twice_is_delivered_once() -> None:
    events = [make_event(n, 1_700_000_000 - n // 3) for n in range(12)]
    relay = FakeRelay(events, cap=500, seed=2)

    async def twice(filters: list[dict[str, object]]) -> list[object]:
        reply = await relay.query(filters)
        return [*reply, *reply]

    ids: list[str] = []
    after: Position | None = None
    for _ in range(100):
        page = await read_page(twice, [BASE], after=after, limit=4, accept=keep)
        ids.extend(str(i["id"]) for i in page.items)
        if page.next_position is None:
            break
        after = page.next_position
    assert ids == declared_order(events)


async def test_a_page_may_fill_its_byte_bound_exactly() -> None:
    # max_bytes is a bound the page may reach: the item that would cross it is cut, the
    # one that reaches it exactly is not (as the window cuts it: bisect_right).
    events = [make_event(n, 1_700_000_000 - n) for n in range(6)]
    page = await read_page(FakeRelay(events, cap=500, seed=0).query, [BASE], after=None,
                           limit=5, accept=keep, max_bytes=3, size_of=lambda item: 1)
    assert len(page.items) == 3 and page.cut_by_bytes and page.next_position is not None


def test_a_limit_past_the_relay_cap_is_our_bug() -> None:
    # Past the cap, a full page would need the relay to send more than it ever does.
    with pytest.raises(ValueError):
        trio.run(lambda: read_page(FakeRelay([], cap=5, seed=0).query, [BASE], after=None,
                                   limit=6, accept=keep, cap=5))


class _BoundedRelay(FakeRelay):
    """A FakeRelay whose answer fails as too large (the pool's AnswerTooLarge) when it
    holds more than `heavy_bound` of the events in `heavy`: a member's tag-heavy messages
    against MAX_QUERY_BYTES."""

    def __init__(self, events: Sequence[Mapping[str, object]], heavy: set[str],
                 heavy_bound: int) -> None:
        super().__init__(events, cap=RELAY_MAX_LIMIT, seed=3)
        self.heavy, self.heavy_bound = heavy, heavy_bound

    async def query(self, filters: list[dict[str, object]]) -> list[object]:
        reply = await super().query(filters)
        held = {str(e["id"]) for e in reply if isinstance(e, Mapping)} & self.heavy
        if len(held) > self.heavy_bound:
            raise AnswerTooLarge("too large")
        return reply


async def test_a_sweep_cut_for_a_heavy_second_cuts_no_later_second() -> None:
    # 50 heavy messages in one second (an answer holds 20 of them at most), then an
    # ordinary second of 40 and an older one of 5. The heavy second is read in part and
    # said (an overflow second, as a second past the relay's cap is); the sweep's smaller
    # limit once held for the rest of the page, and cut the ordinary second to 15.
    heavy = [make_event(n, 1_700_000_000) for n in range(50)]
    ordinary = [make_event(100 + n, 1_699_999_990) for n in range(40)]
    older = [make_event(200 + n, 1_699_999_980) for n in range(5)]
    relay = _BoundedRelay(heavy + ordinary + older, {str(e["id"]) for e in heavy}, 20)
    ids, pages = await read_all(relay, [BASE], 100, RELAY_MAX_LIMIT)
    assert set(declared_order(ordinary + older)) <= set(ids)
    assert len(ids) == len(set(ids))
    assert ids == [i for i in declared_order(heavy + ordinary + older) if i in set(ids)]
    assert {s for p in pages for s in p.overflow_seconds} == {1_700_000_000}


class _CountingBoundedRelay(_BoundedRelay):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.queries = 0

    async def query(self, filters: list[dict[str, object]]) -> list[object]:
        self.queries += 1
        return await super().query(filters)


async def test_a_second_whose_every_event_is_too_large_but_one_is_swept_one_at_a_time() -> None:
    # Three messages in one second, each alone the most an answer holds: the main part's
    # ask goes down to 1, then the sweep's limit down to 1 (not 2, which still holds two),
    # and the read goes on past the second (said an overflow second, as documented)
    # instead of failing.
    heavy = [make_event(n, 1_700_000_000) for n in range(3)]
    ordinary = [make_event(100 + n, 1_699_999_990 - n) for n in range(5)]
    relay = _BoundedRelay(heavy + ordinary, {str(e["id"]) for e in heavy}, 1)
    # cap 256: halving passes through 2 (from 500 it goes 3 -> 1 and never meets it).
    ids, pages = await read_all(relay, [BASE], 100, 256)
    assert set(declared_order(ordinary)) <= set(ids)
    assert ids == [i for i in declared_order(heavy + ordinary) if i in set(ids)]
    assert 1_700_000_000 in {s for p in pages for s in p.overflow_seconds}


async def test_an_answer_too_large_is_asked_again_at_half_the_size() -> None:
    # 50 heavy messages, 20 at most an answer: halving `ask` from the relay's cap (500)
    # reaches a size that fits in a handful of tries, not hundreds of 16 MiB answers.
    heavy = [make_event(n, 1_700_000_000 - n) for n in range(50)]
    relay = _CountingBoundedRelay(heavy, {str(e["id"]) for e in heavy}, 20)
    ids, _ = await read_all(relay, [BASE], 100, RELAY_MAX_LIMIT)
    assert ids == declared_order(heavy)
    assert relay.queries <= 20, relay.queries


class _RefusalCountingRelay(_BoundedRelay):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.too_large = 0

    async def query(self, filters: list[dict[str, object]]) -> list[object]:
        try:
            return await super().query(filters)
        except AnswerTooLarge:
            self.too_large += 1
            raise


async def test_a_heavy_main_part_shrinks_the_ask_not_the_sweep_of_an_ordinary_second() -> None:
    # A page that starts inside an ordinary second of 150 messages (a cursor after the
    # first 100) sweeps its 50 left, while the main part below meets 60 heavy messages
    # (20 at most an answer). The main part's ask is halved first: the sweep keeps the
    # relay's cap and reads the second whole. Halving the sweep first took it down to 1,
    # said the second an overflow second, and lost 49 of its messages.
    ordinary = [make_event(n, 1_700_000_000) for n in range(150)]
    heavy = [make_event(1000 + n, 1_699_999_000 - n) for n in range(60)]
    relay = _BoundedRelay(ordinary + heavy, {str(e["id"]) for e in heavy}, 20)
    ids, pages = await read_all(relay, [BASE], 100, RELAY_MAX_LIMIT)
    assert ids == declared_order(ordinary + heavy)
    assert not [s for p in pages for s in p.overflow_seconds]


async def test_each_too_large_size_is_asked_once_a_page() -> None:
    # The smaller ask holds for the rest of the page (`max_ask`): a page of 100 heavy
    # messages, 20 at most an answer, meets "too large" only on the way down from the
    # first ask (102 -> 51 -> 25 -> 12: three), not again in each of its rounds.
    heavy = [make_event(n, 1_700_000_000 - n) for n in range(200)]
    relay = _RefusalCountingRelay(heavy, {str(e["id"]) for e in heavy}, 20)
    page = await read_page(relay.query, [BASE], after=None, limit=100, accept=keep,
                           cap=RELAY_MAX_LIMIT)
    assert [str(e["id"]) for e in page.items] == declared_order(heavy)[:len(page.items)]
    assert len(page.items) > 20
    assert relay.too_large == 3, relay.too_large
