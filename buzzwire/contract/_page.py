"""A channel.read page's size: how the host counts an event's bytes, the page's bound, and
the JSON values a page within that bound can hold.

The host cuts a page before the event that would take the sum of `page_bytes` over its
events past MAX_PAGE_BYTES (daemon/relay/paging.py, daemon/relay/windows.py; a page holds
at least one event, so a lone larger event still gets through, alone). The agent client
bounds the JSON values it will parse in an answer by what such a page holds,
MAX_PAGE_VALUES (buzz_broker_client._bounds). Both read the one number here: a page the
host serves is a page the client reads, however its events spend their bytes (2,000
one-letter tags each, say), and what a hostile host can make the client build stays
bounded by that page, not by the client's far larger byte bound (64 MiB: 44 million
values as `[],` repeated).

Why bytes bound values (counted as `buzzwire.jsonvalues.values_at_most` counts them: a
`,:[{` outside strings, or a string):
- In JSON text, each counted byte needs an uncounted one: a `[` or `{` has its closer, a `,`
  or `:` is followed by a value (a scalar's first byte, or a container's opener, which
  shares that container's closer), and a string is at least its two quotes. No uncounted
  byte serves more than two counted ones, so `size` bytes hold at most `values_in(size)`
  (`[],` repeated reaches it).
- `page_bytes` charges an event 300 bytes for its fixed members, which are 16 counted (the
  object's `{`, seven `:`, six `,`, the tags' `[`, the `,` before it in the page), and each
  tag value 3 bytes beyond its own, which is at most two counted (its `,` or its tag's `[`,
  and a `,` between tags: a tag of n values has n + 1). Every event is charged more than
  3/2 bytes a counted value, as JSON text is, so a page within MAX_PAGE_BYTES holds at most
  `values_in(MAX_PAGE_BYTES)`.

WARNING: the second holds only for events with no empty tag (`[]` is two counted values
for no bytes charged): the host drops such events before they reach a page
(daemon/operations/channel_read.py `_tags_ok`). tests/contract/test_page_size.py holds
both, with the densest events the host serves.
"""

from __future__ import annotations

from typing import Final

from ._limits import MAX_PAGE_BYTES
from ._outcomes import Event

__all__ = ["MAX_PAGE_BYTES", "MAX_PAGE_VALUES", "page_bytes", "values_in"]

#: What an event's fixed members (id, pubkey, sig, kind, created_at, JSON punctuation)
#: add to its content and tags: 333 bytes of compact JSON at the least.
_EVENT_OVERHEAD: Final = 300
#: What a tag value's JSON adds to its own bytes: its quotes and the comma after it.
_TAG_VALUE_OVERHEAD: Final = 3


def page_bytes(event: Event) -> int:
    """An event's size as a page counts it: UTF-8 content, tag strings, fixed members."""
    tag_bytes = sum(len(value.encode("utf-8")) + _TAG_VALUE_OVERHEAD
                    for tag in event.tags for value in tag)
    return len(event.content.encode("utf-8")) + tag_bytes + _EVENT_OVERHEAD


def values_in(size: int) -> int:
    """The most JSON values (`values_at_most`'s count) `size` bytes can hold: of JSON text,
    or of a page's events as `page_bytes` counts them (module docstring)."""
    return 2 * size // 3 + 1


#: The most JSON values the events of one page hold (the envelope around them is the
#: reader's to add).
MAX_PAGE_VALUES: Final = values_in(MAX_PAGE_BYTES)
