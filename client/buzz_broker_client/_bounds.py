"""What one answer may cost the client: bytes read, and JSON values built, per action.

Why: a response is read whole, then parsed, shape-checked and its events verified. Bytes
alone do not bound that work: one event whose tags are millions of `[]` is three bytes a
value, and each value costs ~170 bytes of Python objects and microseconds to build, check
and verify (64 MiB of them: 3.6 GiB and 77 s of CPU). So each action has a byte bound,
enforced while the body is read (`_transport.exchange`), and a bound on JSON values,
counted in the raw bytes before `json` builds a single object (`values_at_most`).

The bounds are derived from what an honest answer to the request can hold:
- every action but `channel.read` and `storage.get`: a Published or agents outcome (ids,
  a name of 120 characters, a few field names), or an error whose message is one line
  for operators: `SMALL_ANSWER_BYTES`, `SMALL_ANSWER_VALUES`.
- `storage.get`: the record's value, at most 65,535 bytes of UTF-8, which JSON escaping
  can grow six times (`\\u0001`).
- `channel.read` bytes: its effective limit (the `limit` sent, else 100) times what one
  event may take, `EVENT_BYTES` (the largest relay frame the host reads, 1 MiB: docs/
  configuration.md `max_result_bytes`), never past `MAX_RESPONSE_BYTES`.
- `channel.read` values: what the host's page can hold, not an allowance per event. The
  host cuts a page at the contract's MAX_PAGE_BYTES of `page_bytes`, which charges each
  tag value 20 bytes beyond its text, and the contract derives from it the values such a
  page's events hold, `MAX_PAGE_VALUES` (419,431: a tenth of the page's bytes). A page
  always holds one event, so a lone event past the page bound is read too: at most
  `EVENT_BYTES` of an event's JSON, which holds two values in five bytes
  (`event_values_in`, the same 419,431). So a page the host serves is always read, however
  its events spend their bytes (an average per event refused 18 events of 2,000
  one-letter tags, which Buzz's own client shows), and never more than the byte bound
  itself can hold (`values_in`, two in three bytes): at limit 1 the byte bound is the
  tighter. What a hostile host can make the client build is then bounded by that page:
  ~420,000 values, measured at 64 MiB of peak RSS growth and 0.9 s of CPU for one
  judgement (`judge`) of the densest answer the bound admits at limit 100 (one event of
  209,700 `["x"]` tags; `[]` tags: 33 MiB, 0.6 s), by `resource.getrusage` ru_maxrss
  before and after the call, in a fresh process per shape (the same measurement of the
  bound before, 2.8 million values: 417 MiB and 7.7 s), not the 44 million that 64 MiB
  of `[],` holds.

The value count is the shared one (buzzwire.jsonvalues `values_at_most`), which the
custodian's frames and a backup's lines are counted by too.

Held by tests/client/test_client.py
`::test_the_value_bound_holds_the_densest_page_the_host_serves_at_every_limit` and
`::test_a_page_of_more_json_values_than_events_hold_is_no_answer`, and against the real
host and relay by tests/e2e/test_client_e2e.py (pages of 2,000-tag messages, limit 1 and
limit 100); the contract's derivation by tests/contract/test_page_size.py.
"""

from __future__ import annotations

from typing import Final

from buzzwire.contract import (
    MAX_MEMORY_BODY_BYTES, MAX_PAGE_VALUES, ChannelReadArgs, Request, event_values_in,
    values_in,
)

from ._transport import MAX_RESPONSE_BYTES

__all__ = [
    "MAX_RESPONSE_BYTES", "SMALL_ANSWER_BYTES", "SMALL_ANSWER_VALUES", "EVENT_BYTES",
    "PAGE_VALUES", "response_bytes", "response_values",
]

#: An answer of any action but channel.read and storage.get.
SMALL_ANSWER_BYTES: Final = 64 * 1024
SMALL_ANSWER_VALUES: Final = 1024
#: One event on a page: bytes of its JSON.
EVENT_BYTES: Final = 1024 * 1024
#: The JSON values of a page's events: what the host's page holds (contract
#: MAX_PAGE_VALUES), or a lone event past the page bound (at most EVENT_BYTES of an
#: event's JSON, which holds no empty tag: contract `event_values_in`).
PAGE_VALUES: Final = max(MAX_PAGE_VALUES, event_values_in(EVENT_BYTES))
#: The envelope around a page (its members, a cursor of at most 256 bytes).
_ENVELOPE_BYTES: Final = 64 * 1024
_ENVELOPE_VALUES: Final = 64
#: JSON escapes a character in at most six bytes (`\u0001`).
_ESCAPE_GROWTH: Final = 6


def response_bytes(request: Request) -> int:
    """The most bytes an answer to `request` may hold."""
    if isinstance(request.args, ChannelReadArgs):
        return min(MAX_RESPONSE_BYTES, request.args.effective_limit * EVENT_BYTES + _ENVELOPE_BYTES)
    if request.action == "storage.get":
        return _ESCAPE_GROWTH * MAX_MEMORY_BODY_BYTES + SMALL_ANSWER_BYTES
    return SMALL_ANSWER_BYTES


def response_values(request: Request) -> int:
    """The most JSON values (member names included) an answer to `request` may hold."""
    if isinstance(request.args, ChannelReadArgs):
        return min(values_in(response_bytes(request)), PAGE_VALUES + _ENVELOPE_VALUES)
    return SMALL_ANSWER_VALUES
