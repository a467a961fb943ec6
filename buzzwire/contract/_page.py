"""A channel.read page's size: how the host counts an event's bytes, the page's bound, and
the JSON values a page within that bound can hold.

The host cuts a page before the event that would take the sum of `page_bytes` over its
events past MAX_PAGE_BYTES (daemon/relay/paging.py, daemon/relay/windows.py; a page holds
at least one event, so a lone larger event would still get through, alone). No event the
host serves is that large: it drops one whose content is past MAX_CONTENT_BYTES or whose
JSON is past MAX_ENCODED_EVENT_BYTES (daemon/operations/channel_read.py `_size_ok`:
Buzz's SDK refuses a whole answer holding one), and 512 KiB of JSON is charged at most
20/3 of its bytes (below), 3.3 MiB. The agent client bounds the JSON values it will parse
in an answer by what such a page holds, MAX_PAGE_VALUES (buzz_broker_client._bounds).
Both read the one number here: a page the host serves is a page the client reads, however
its events spend their bytes (2,000 one-letter tags each, say), and what a hostile host
can make the client build stays bounded by that page, not by the client's far larger byte
bound (64 MiB: 44 million values as `[],` repeated).

Why page bytes bound values (counted as `buzzwire.jsonvalues.values_at_most` counts them:
the larger of one more than the `,:[{` outside strings, and the strings):
- An event's counted separators are 16 for its fixed members (the object's `{`, seven `:`,
  six `,`, the tags' `[`, and the `,` before it in the page), and n + 1 for a tag of n
  values (its `[`, a `,` between its values, and the `,` after it): at most two a tag
  value, reached by a one-value tag. Its strings (seven member names, four string members,
  one each tag value) are fewer. Content is bytes with no counted value.
- `page_bytes` charges the fixed members `_EVENT_OVERHEAD` (300) and each tag value
  `_TAG_VALUE_OVERHEAD` (20) beyond its text, so each counted value is charged at least
  `_PAGE_BYTES_PER_VALUE`, the least of 300 / 16 and 20 / 2: 10 bytes. Events charged
  `size` in all hold at most `size / 10` counted values, and the page's answer one more
  (its first value follows no separator): `page_values(size)`, and a page within
  MAX_PAGE_BYTES at most MAX_PAGE_VALUES (419,431).
- Why 20: a tag value costs the reader far more as objects (measured with
  daemon.relay.pool `decoded_size`: ~98 bytes a value of `["t","x"]` tags, ~146 a `[""]`
  tag, before the client's `Event` tuples), so no charge a page of honest messages can
  carry reaches it; 20 is where the page's bound meets a lone event's. A page always holds
  one event, so the client also reads one event past MAX_PAGE_BYTES, alone (which this
  host no longer serves, above; the client's bound keeps that margin): at most a relay
  frame, 1 MiB of JSON, where a tag of n values takes at least 3n + 2 bytes (`[""],` for
  n = 1) for its n + 1 counted, and the fixed members 334 for 16: two counted values in
  five bytes at most, `event_values_in`, 419,431 for 1 MiB.
  A larger charge would cut honest tag-heavy pages sooner and lower no client's bound.
  Per byte of JSON an event is charged most by a tag of many empty values: `"",` is three
  bytes charged 20, so an event the host serves (at most MAX_ENCODED_EVENT_BYTES of JSON)
  is charged less than 20/3 of that, within MAX_PAGE_BYTES.
  An honest Buzz message (8 KB of content, 55 tags of a 64-hex id, a relay and a marker)
  is charged ~18 KB: 100 fit a page twice over (tests/contract/test_page_size.py).
- JSON text at large holds more: each counted byte needs an uncounted one (a `[` or `{` its
  closer, a `,` or `:` the value after it, a string its quotes), none serving more than
  two, so `size` bytes hold at most `values_in(size)` (`[],` repeated reaches it). The
  client bounds a reply by that too, where its byte bound is the tighter.

WARNING: the page bound holds only for events with no empty tag (`[]` is two counted values
for no bytes charged, and three bytes of JSON): the host drops such events before they reach
a page (daemon/operations/channel_read.py `_tags_ok`), as it drops oversized ones
(`_size_ok`). tests/contract/test_page_size.py holds each bound, with the densest events
the host serves.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Final

from ._limits import MAX_PAGE_BYTES
from ._outcomes import Event

__all__ = ["MAX_PAGE_BYTES", "MAX_PAGE_VALUES", "event_values_in", "page_bytes", "page_values",
           "values_in"]

#: What an event's fixed members (id, pubkey, sig, kind, created_at, JSON punctuation)
#: add to its content and tags: 333 bytes of compact JSON at the least.
_EVENT_OVERHEAD: Final = 300
#: The counted values (`values_at_most`) those fixed members hold at most: the object's `{`,
#: seven `:`, six `,`, the tags' `[`, and the `,` before the event in a page.
_EVENT_VALUES: Final = 16
#: What a tag value is charged beyond its own bytes (module docstring: where the page's
#: bound meets a lone event's; far below the ~98 bytes of objects a value costs).
_TAG_VALUE_OVERHEAD: Final = 20
#: The counted values one tag value brings at most: its `,` or its tag's `[`, and the `,`
#: after a one-value tag.
_TAG_VALUE_VALUES: Final = 2
#: The least `page_bytes` any counted value of an event is charged.
_PAGE_BYTES_PER_VALUE: Final = min(Fraction(_EVENT_OVERHEAD, _EVENT_VALUES),
                                   Fraction(_TAG_VALUE_OVERHEAD, _TAG_VALUE_VALUES))


def page_bytes(event: Event) -> int:
    """An event's size as a page counts it: UTF-8 content, tag strings, fixed members."""
    tag_bytes = sum(len(value.encode("utf-8")) + _TAG_VALUE_OVERHEAD
                    for tag in event.tags for value in tag)
    return len(event.content.encode("utf-8")) + tag_bytes + _EVENT_OVERHEAD


def page_values(size: int) -> int:
    """The most JSON values (`values_at_most`'s count) events charged `size` by
    `page_bytes` hold, as a page's answer counts them (module docstring)."""
    return math.floor(size / _PAGE_BYTES_PER_VALUE) + 1


def event_values_in(size: int) -> int:
    """The most JSON values `size` bytes of events the host serves (no empty tag) hold:
    two in five bytes, `[""],` repeated (module docstring)."""
    return 2 * size // 5 + 1


def values_in(size: int) -> int:
    """The most JSON values (`values_at_most`'s count) `size` bytes of any JSON text can
    hold: two in three bytes, `[],` repeated (module docstring)."""
    return 2 * size // 3 + 1


#: The most JSON values the events of one page hold (the envelope around them is the
#: reader's to add).
MAX_PAGE_VALUES: Final = page_values(MAX_PAGE_BYTES)
