"""A read page's size (buzzwire.contract `_page`): the JSON values its bytes can hold.

The host cuts a page by `page_bytes` at MAX_PAGE_BYTES; the agent client bounds an answer's
JSON values by MAX_PAGE_VALUES, derived from that bound. These tests hold the derivation:
- any JSON text of n bytes holds at most `values_in(n)` values as `values_at_most` counts
  them, and the densest text reaches it;
- the events of any page the host can serve (no empty tag: the host drops those) hold
  fewer than `page_values` of their `page_bytes` (a tenth of a byte each), so a page at the
  bound is within MAX_PAGE_VALUES, and the densest such page comes close to it (the bound
  is not slack);
- a lone event past the page bound holds fewer than `event_values_in` of its JSON's bytes,
  and the densest reaches it;
- no event the host serves (at most MAX_ENCODED_EVENT_BYTES of JSON) is charged past the
  page bound;
- an honest Buzz message still fits 100 to a page.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from buzzwire.contract import (
    MAX_ENCODED_EVENT_BYTES, MAX_PAGE_BYTES, MAX_PAGE_VALUES, Event, ReadOutcome, Verdict, encode_response,
    event_values_in, page_bytes, page_values, values_in,
)
from buzzwire.jsonvalues import values_at_most
from tests.contract.vectors import CHANNEL, REQUEST_ID


def _count(data: bytes) -> int:
    """The exact count, outside strings (recount_past 0), never cut short."""
    return values_at_most(data, 0, len(data) + 2)


def _body(events: list[Event]) -> bytes:
    outcome = ReadOutcome(messages=tuple(events), next_cursor=None)
    return encode_response(REQUEST_ID, Verdict.succeeded("channel.read", outcome))


def _event(tags: list[list[str]], content: str = "", created_at: int = 0, kind: int = 0) -> Event:
    return Event(id="0" * 64, pubkey="1" * 64, created_at=created_at, kind=kind,
                 tags=tuple(tuple(tag) for tag in tags), content=content, sig="2" * 128)


def _events_values(events: list[Event]) -> int:
    """The values the events add to a page's answer (the envelope is the reader's)."""
    return _count(_body(events)) - _count(_body([]))


def _events_json_bytes(events: list[Event]) -> int:
    """The bytes the events add to a page's answer."""
    return len(_body(events)) - len(_body([]))


# ------------------------------------------------------------------ JSON text

_DENSEST = (
    b"[" + b"[]," * 999 + b"[]]",                 # `[],` repeated: two counted in three bytes
    b"[" + b"{}," * 999 + b"{}]",
    b"[" * 500 + b"]" * 500,
    b"[" + b"0," * 999 + b"0]",
    b"[" + b'"",' * 999 + b'""]',
    b"{" + b'"":[],' * 500 + b'"":[]}',
    b'"' + b",:[{" * 500 + b'"',                   # separators inside a string are not values
    b"0",
)

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10) | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=2), inner, max_size=6),
    max_leaves=60,
)


def test_the_densest_json_texts_hold_at_most_values_in_their_bytes() -> None:
    for text in _DENSEST:
        json.loads(text)  # each is JSON text
        assert _count(text) <= values_in(len(text)), text[:20]
    densest = _DENSEST[0]
    assert _count(densest) == values_in(len(densest))  # reached: the bound is the ratio


@settings(max_examples=300, deadline=None)
@given(_JSON, st.booleans())
def test_any_json_text_holds_at_most_values_in_its_bytes(value: Any, ascii_only: bool) -> None:
    for separators in ((",", ":"), (", ", ": ")):
        text = json.dumps(value, separators=separators, ensure_ascii=ascii_only).encode("utf-8")
        assert _count(text) <= values_in(len(text))


# ------------------------------------------------------------------ a page's events

_STRING = st.text(st.characters(blacklist_categories=("Cs",)), max_size=6) | st.sampled_from(
    ["", ",", ":", "[", "{", '"', "\\", "\x01", ",:[{", "é"])
_TAG = st.lists(_STRING, min_size=1, max_size=5)  # never empty: the host drops `[]`


_EVENTS = st.lists(st.tuples(st.lists(_TAG, max_size=12), _STRING,
                             st.integers(0, 2**40), st.integers(0, 65535)), max_size=6)


@settings(max_examples=300, deadline=None)
@given(_EVENTS)
def test_a_pages_events_hold_fewer_than_page_values_of_their_page_bytes(
        specs: list[tuple[list[list[str]], str, int, int]]) -> None:
    events = [_event(tags, content, created_at, kind) for tags, content, created_at, kind in specs]
    charged = sum(map(page_bytes, events))
    assert _events_values(events) < page_values(charged)
    assert 10 * _events_values(events) <= charged  # the least charge a counted value: 10


@settings(max_examples=300, deadline=None)
@given(_EVENTS)
def test_events_hold_fewer_than_event_values_in_their_json_bytes(
        specs: list[tuple[list[list[str]], str, int, int]]) -> None:
    events = [_event(tags, content, created_at, kind) for tags, content, created_at, kind in specs]
    assert _events_values(events) < event_values_in(_events_json_bytes(events))


def test_max_page_values_is_a_tenth_of_the_page_bound() -> None:
    # A one-value tag is charged 20 bytes and holds two counted values (its `[` and the `,`
    # after it): 10 bytes a value, the least any event's value is charged.
    assert MAX_PAGE_VALUES == MAX_PAGE_BYTES // 10 + 1 == 419_431
    assert page_bytes(_event([[""]])) - page_bytes(_event([])) == 20


def _densest_page(tags_per_event: int) -> list[Event]:
    """One-value tags of the empty string (20 bytes charged, two values each), in events of
    `tags_per_event`, until the next would cross MAX_PAGE_BYTES (where the host cuts)."""
    event = _event([["h", CHANNEL]] + [[""]] * tags_per_event)
    return [event] * (MAX_PAGE_BYTES // page_bytes(event))


def test_the_densest_page_the_host_serves_is_within_max_page_values_and_near_it() -> None:
    for tags in (1_000, 5_000, 60_000):
        events = _densest_page(tags)
        held = _events_values(events)
        assert held <= MAX_PAGE_VALUES
        assert held > (0.85 if tags == 60_000 else 0.95) * MAX_PAGE_VALUES, tags


def test_the_densest_lone_event_is_within_event_values_in_and_reaches_it() -> None:
    # As many one-value tags as one relay frame's 1 MiB of JSON holds. The host serves an
    # event past the page bound alone, and the client's bound must hold it (PAGE_VALUES);
    # the densest is charged just the page bound: 20 a tag value is where the two meet.
    frame = 1024 * 1024
    event = _event([["h", CHANNEL]] + [[""]] * ((frame - 400) // 5))
    size = _events_json_bytes([event])
    assert frame - 100 < size <= frame
    assert abs(page_bytes(event) - MAX_PAGE_BYTES) < 2_000
    held = _events_values([event])
    assert held < event_values_in(size)
    assert held > 0.999 * event_values_in(size)
    assert event_values_in(frame) == MAX_PAGE_VALUES  # where the charge of 20 was chosen


def test_no_event_the_host_serves_is_charged_past_the_page_bound() -> None:
    # The host drops an event past MAX_ENCODED_EVENT_BYTES of JSON (channel_read
    # `_size_ok`). The most charged per byte is a tag of many empty values (`"",`: three
    # bytes charged 20); at the size bound it is charged within MAX_PAGE_BYTES, so a page
    # the host serves never holds one event past the page bound alone.
    one_valued = _event([["h", CHANNEL]] + [[""]] * ((MAX_ENCODED_EVENT_BYTES - 400) // 5))
    assert _events_json_bytes([one_valued]) <= MAX_ENCODED_EVENT_BYTES
    assert page_bytes(one_valued) < MAX_PAGE_BYTES
    many = _event([["h", CHANNEL], [""] * ((MAX_ENCODED_EVENT_BYTES - 400) // 3)])
    assert MAX_ENCODED_EVENT_BYTES - 100 < _events_json_bytes([many]) <= MAX_ENCODED_EVENT_BYTES
    assert 0.99 * MAX_ENCODED_EVENT_BYTES * 20 / 3 < page_bytes(many) < MAX_PAGE_BYTES


def test_an_honest_buzz_message_still_fits_100_to_a_page() -> None:
    # A Buzz message of a few KB of content (multi-byte characters among them) and 55 tags
    # of 64-hex ids, each with a relay and a marker: 100 fit one page.
    ids = [f"{i:064x}" for i in range(55)]
    tags = [["h", CHANNEL]] + [["e", value, "wss://relay.buzz.example.com", "mention"]
                               for value in ids]
    event = _event(tags, "é" * 2_000 + "x" * 4_000)
    assert 2 * 100 * page_bytes(event) <= MAX_PAGE_BYTES  # with room to spare: ~18 KB each


def test_a_message_of_2000_one_letter_tags_is_charged_like_its_objects_not_its_text() -> None:
    # The reported case: 18 members' events of 2,000 one-letter tags (Buzz shows them) are
    # one page; 49 such events fill it, each ~84 KB charged for ~24 KB of JSON.
    events = [_event([["h", CHANNEL]] + [["t", "x"]] * 1999, f"tags {i}") for i in range(18)]
    assert sum(map(page_bytes, events)) < MAX_PAGE_BYTES
    assert 100_000 < _events_values(events) < page_values(sum(map(page_bytes, events)))
    assert MAX_PAGE_BYTES // page_bytes(events[0]) == 49
