"""A read page's size (buzzwire.contract `_page`): the JSON values its bytes can hold.

The host cuts a page by `page_bytes` at MAX_PAGE_BYTES; the agent client bounds an answer's
JSON values by MAX_PAGE_VALUES, derived from that bound. These tests hold the derivation:
- any JSON text of n bytes holds at most `values_in(n)` values as `values_at_most` counts
  them, and the densest text reaches it;
- the events of any page the host can serve (no empty tag: the host drops those) hold at
  most `values_in` of their `page_bytes`, so a page at the bound is within MAX_PAGE_VALUES,
  and the densest such page comes close to it (the bound is not slack).
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from buzzwire.contract import (
    MAX_PAGE_BYTES, MAX_PAGE_VALUES, Event, ReadOutcome, Verdict, encode_response, page_bytes,
    values_in,
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


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.lists(_TAG, max_size=12), _STRING,
                          st.integers(0, 2**40), st.integers(0, 65535)), max_size=6))
def test_a_pages_events_hold_at_most_values_in_their_page_bytes(
        specs: list[tuple[list[list[str]], str, int, int]]) -> None:
    events = [_event(tags, content, created_at, kind) for tags, content, created_at, kind in specs]
    assert _events_values(events) < values_in(sum(map(page_bytes, events)))


def test_the_densest_page_the_host_serves_is_within_max_page_values_and_near_it() -> None:
    # One-value tags of the empty string: three bytes charged, two values each. Events as
    # large as a relay frame allows, until the next would cross MAX_PAGE_BYTES (where the
    # host cuts the page).
    events: list[Event] = []
    total = 0
    while True:
        event = _event([["h", CHANNEL]] + [[""]] * 60_000)
        if total + page_bytes(event) > MAX_PAGE_BYTES:
            break
        events.append(event)
        total += page_bytes(event)
    held = _events_values(events)
    assert held <= MAX_PAGE_VALUES
    assert held > 0.95 * MAX_PAGE_VALUES


def test_the_reviewers_page_of_many_tags_is_far_within_max_page_values() -> None:
    # The reported case: 18 members' events of 2,000 one-letter tags (Buzz shows them).
    events = [_event([["h", CHANNEL]] + [["t", "x"]] * 1999, f"tags {i}") for i in range(18)]
    assert sum(map(page_bytes, events)) < MAX_PAGE_BYTES
    assert 100_000 < _events_values(events) < values_in(sum(map(page_bytes, events)))
