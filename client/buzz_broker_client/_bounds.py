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
- `channel.read`: its effective limit (the `limit` sent, else 100) times what one event
  may take, `EVENT_BYTES` (the largest relay frame the host reads, 1 MiB: docs/
  configuration.md `max_result_bytes`) and `EVENT_VALUES` (an event's seven members and
  its tags: a Buzz message has a channel tag, thread tags and at most 50 mentions; 1,024
  on average over the page leaves several times that), never past `MAX_RESPONSE_BYTES`.

The value count is the shared one (buzzwire.jsonvalues `values_at_most`), which the
custodian's frames and a backup's lines are counted by too.
"""

from __future__ import annotations

from typing import Final

from buzzwire.contract import MAX_MEMORY_BODY_BYTES, ChannelReadArgs, Request

from ._transport import MAX_RESPONSE_BYTES

__all__ = [
    "MAX_RESPONSE_BYTES", "SMALL_ANSWER_BYTES", "SMALL_ANSWER_VALUES", "EVENT_BYTES",
    "EVENT_VALUES", "response_bytes", "response_values",
]

#: An answer of any action but channel.read and storage.get.
SMALL_ANSWER_BYTES: Final = 64 * 1024
SMALL_ANSWER_VALUES: Final = 1024
#: One event on a page: bytes of its JSON, and JSON values on average over the page.
EVENT_BYTES: Final = 1024 * 1024
EVENT_VALUES: Final = 1024
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
        return request.args.effective_limit * EVENT_VALUES + _ENVELOPE_VALUES
    return SMALL_ANSWER_VALUES
