"""The rules a request (or a response) can break, and the one table of what an agent is told.

Rules (issue 25 item 3; NIP-BA "Result": `message` is operator-facing text that must not
disclose keys, credentials or decrypted payloads):
- `Rule` is the table: each member's value is the reason template an `invalid_request`
  message carries. A template holds only the host's own words and the host's own limits
  (`{max}`, `{low}`, `{high}`, `{choices}`, `{expected}`, `{status}`, `{code}`: filled from
  this package's constants and enums, never from the request). So no value a client sent,
  and therefore no secret pasted into one, can ride along.
- The agent's message is `"<where>: <reason>"` (`refusal_message`). `<where>` is the JSON
  pointer of the fault as `_envelopes.shown_pointer` writes it: a member name the contract
  defines is kept, an array index is kept, and a member name the client chose (an unknown
  member, a repeated one, anything below one) is written by position, `<member N>` (the
  N-th member of its object in document order, from 1), never by its text. The pointer is
  bounded (`MAX_SHOWN_POINTER_CHARS`) whatever the nesting.
- The operator's `detail` is the same reason unless the reader knows more (a JSON syntax
  fault's position, a Python type name in `build_request`); it is logged, never answered.
- Every other code keeps its one fixed text (`_codes.MESSAGES`).

WARNING: tests/contract/test_refusal_messages.py holds one provoking request per `Rule`
and fails when a member is added without one; docs/protocol.md §5 describes the form.
"""

from __future__ import annotations

import enum
from typing import Final

from ._limits import MAX_MEMORY_BODY_BYTES, MAX_OBSERVER_BYTES, MAX_SLUG_SEGMENT_CHARS

__all__ = ["Rule", "MAX_SHOWN_POINTER_CHARS", "refusal_message"]

#: Longest `<where>` an agent is shown: 16 levels (MAX_NESTING) of the longest member name
#: fit; a longer pointer is cut with "…". Bounds every message (issue 25: bounded).
MAX_SHOWN_POINTER_CHARS: Final = 300


class Rule(enum.Enum):
    """One rule of the wire; the value is the reason an agent is told (module docstring)."""

    # -- the document (raised before correlation: no envelope carries these on the host)
    #: not UTF-8, not JSON, NaN, trailing bytes, nesting too deep
    SYNTAX = "not one strict JSON document"
    TOP_NOT_OBJECT = "top level is not an object"
    REQUEST_ID = "missing, repeated, or not a usable requestId"
    # -- strictness anywhere in the document, first in document order
    NULL = "null is never a legal value"
    REPEATED_MEMBER = "member appears more than once"
    MEMBER_NAME_SURROGATE = "member name holds a lone surrogate"
    LONE_SURROGATE = "string holds a lone surrogate"
    NOT_INTEGER = "number is not an integer"
    INTEGER_PAST_64_BITS = "integer outside signed 64 bits"
    # -- the envelope
    TYPE = "missing or not {expected}"
    U16 = "missing or not a u16 integer"
    # -- strict objects
    EXPECTED_OBJECT = "expected an object"
    UNKNOWN_MEMBER = "unknown member"
    MISSING_MEMBER = "missing required member"
    # -- scalars
    EXPECTED_STRING = "expected a string"
    EXPECTED_BOOLEAN = "expected true or false"
    EXPECTED_INTEGER = "expected an integer"
    INTEGER_RANGE = "integer outside {low}..{high}"
    CHANNEL = "expected a channel UUID"
    HEX64 = "expected 64 hex characters"
    PUBKEY = "not an x-only point on secp256k1"
    VISIBLE_ASCII = "expected 1-{max} bytes of printable ASCII without spaces"
    #: NIP-AE's slug grammar, one rule per part of it (`_ids.slug`); a slug over its byte
    #: bound is `BYTES`.
    SLUG = "expected core, or mem/ then one or more segments separated by single /"
    SLUG_CHARACTER = "a segment holds a character other than a-z, 0-9, _ and -"
    SLUG_SEGMENT_START = "a segment starts with _ or -, not a-z or 0-9"
    SLUG_SEGMENT_LONG = f"a segment is longer than {MAX_SLUG_SEGMENT_CHARS} characters"
    BLANK = "empty or whitespace-only"
    CHARS = "longer than {max} characters"
    BYTES = "longer than {max} bytes"
    LINE_CHARACTER = "holds a control, line-separator or bidi-override character"
    PROSE_CHARACTER = "holds a control character other than tab, line feed, carriage return"
    ONE_OF = "expected one of {choices}"
    # -- arrays
    EXPECTED_ARRAY = "expected an array"
    EMPTY_ARRAY = "empty array: omit the member instead"
    ITEMS = "more than {max} items"
    # -- rules across the members of one object
    AT_LEAST_ONE = "at least one member must be present"
    AT_LEAST_ONE_BESIDES_TARGET = "at least one member besides target must be present"
    ONE_TARGET = "target must hold exactly one of pubkey, name"
    RECORD_BODY = f"the compact record body is longer than {MAX_MEMORY_BODY_BYTES} bytes"
    FRAMES_BODY = f"frames encode to more than {MAX_OBSERVER_BYTES} bytes"
    # -- what only a client meets (its own arguments, a host's response)
    NOT_JSON_VALUE = "not representable as JSON"
    LOWER_HEX64 = "expected 64 lowercase hex characters"
    LOWER_HEX128 = "expected 128 lowercase hex characters"
    PROTOCOL_VERSION_ONE = "missing or not 1"
    STATUS = "missing or not a status"
    NOT_WITH_STATUS = "member not allowed with {status}"
    REPLAYED = "present but not true (omit it when false)"
    ACTION_NAME = "not an action this host knows"
    ERROR_CODE = "not an error code"
    PAIRING = "{code} may not travel with {status}"

    def reason(self, **bounds: int | str) -> str:
        """The template filled with the host's own `bounds` (never a client's value).

        Raises:
            KeyError: a placeholder was not given (our bug).
        """
        return self.value.format(**bounds)


def refusal_message(shown_pointer: str, reason: str) -> str:
    """The agent's `invalid_request` message: where (already shown-safe) and which rule."""
    where = shown_pointer or "(document)"
    if len(where) > MAX_SHOWN_POINTER_CHARS:
        where = where[: MAX_SHOWN_POINTER_CHARS - 1] + "…"
    return f"{where}: {reason}"
