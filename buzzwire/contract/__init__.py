"""buzzwire.contract: the wire contract of agent-broker.md and NIP-BA, pure (bytes in, values or
bytes out). No I/O, no trio, no clock, no randomness, no logging; stdlib only.

Modules, one job each:
  _json       strict JSON reader over raw bytes (syntax faults vs strictness faults)
  _rules      Rule: every rule of the wire, and the reason an agent is told for it (the one
              table of invalid_request messages)
  _codes      ErrorCode, Status, the PAIRING table, MESSAGES, ContractError
  _limits     every limit, named, with its source
  _ids        identities (channel UUIDs, 64-hex, secp256k1 x-only pubkeys) and scalar checkers
  _text       White_Space trimming, the characters names may not hold, and `printable`, the
              one escape for showing agent text to an operator
  _shapes     table-driven strict objects (read, re-check in construction, write)
  _args       the argument shapes (the nine, then NIP-BA's additions)
  _outcomes   the outcome shapes and the seven-member Event
  _page       a read page's size: `page_bytes`, its bound, and the JSON values that bounds
  _echoes     the identities an outcome echoes from its request (I5), as data, and the check
  _envelopes  request/response envelopes, ActionSpec and ACTIONS (every fixed fact of an
              action), read/encode/parse/build

Two error families: `ContractError` (Remote: bad bytes or values from outside; carries a
code, a JSON pointer and, for invalid_request, the Rule broken) and ValueError/TypeError/AssertionError (Local: our bug).

WARNING: `__all__` below is the package's one surface; docs/internals.md ("daemon/contract")
tabulates it and changes with it.
"""

from ._args import (
    RESPOND_TO, AgentsCreateArgs, AgentsDeleteArgs, AgentsUpdateArgs, AgentTarget,
    ChannelReadArgs, LivenessPingArgs, MessagePostArgs, MessageReplyArgs, ObserverEmitArgs,
    ObserverFrame, ProfileSetArgs, ReactionAddArgs, StorageAddressArgs, PRESENCE_STATUSES,
    PresenceSetArgs, TypingSetArgs, StorageGetArgs,
    StoragePutArgs, compact_json,
)
from ._codes import MESSAGES, PAIRING, ContractError, ErrorCode, Status
from ._echoes import REQUESTER, Echo, Identity, echo_mismatch
from ._envelopes import (
    ACTIONS, REQUEST_MEMBERS, RESERVED_NAMES, ActionSpec, Args, MemberSet, RateClass, Reading,
    Request, Response, Verdict, build_request, encode_request, encode_response, mark_replayed, parse_response, read_request,
    shown_pointer,
)
from ._rules import MAX_SHOWN_POINTER_CHARS, Rule, refusal_message
from ._json import JsonSyntaxError
from ._json import parse as parse_json
from ._ids import is_request_id, is_valid_pubkey, normalize_channel_id, normalize_hex64
from ._limits import (
    ACTION_VERSION, DEFAULT_LIMIT, MAX_ABOUT_CHARS, MAX_CONTENT_BYTES, MAX_CURSOR_BYTES,
    MAX_DISPLAY_NAME_CHARS, MAX_JSON_INT, MAX_KIND, MAX_LIMIT, MAX_MENTIONS, MAX_NESTING,
    MAX_PICTURE_CHARS, MAX_REACTION_CHARS, MAX_REQUEST_ID_BYTES, MAX_SCALAR_CHARS,
    MAX_MEMORY_BODY_BYTES, MAX_SLUG_BYTES, MAX_SLUG_SEGMENT_CHARS, MAX_SYSTEM_PROMPT_CHARS,
    MIN_JSON_INT, MIN_LIMIT,
    PROTOCOL_VERSION, MAX_FRAMES, MAX_OBSERVER_BYTES, MAX_PAGE_BYTES, MAX_U32,
    MAX_ENCODED_EVENT_BYTES,
)
from ._page import MAX_PAGE_VALUES, event_values_in, page_bytes, page_values, values_in
from ._text import WHITE_SPACE, printable, printable_json, printable_json_text, scrub_line, trim
from ._outcomes import (
    AgentsCreateOutcome, AgentsDeleteOutcome, AgentsUpdateOutcome, Event, ObserverEmitOutcome,
    Outcome, PublishOutcome, ReadOutcome, StorageAddressOutcome, StorageGetOutcome,
)

__all__ = [
    # codes and tables
    "ErrorCode", "Status", "PAIRING", "MESSAGES", "ContractError",
    "Rule", "refusal_message", "shown_pointer", "MAX_SHOWN_POINTER_CHARS",
    "ACTIONS", "ActionSpec", "MemberSet", "RateClass", "RESERVED_NAMES", "RESPOND_TO",
    "REQUEST_MEMBERS", "Echo", "Identity", "REQUESTER", "echo_mismatch",
    # requests
    "read_request", "Reading", "Request", "Args", "build_request", "encode_request",
    "ChannelReadArgs", "MessagePostArgs", "MessageReplyArgs", "ReactionAddArgs",
    "ProfileSetArgs", "StorageAddressArgs", "AgentsCreateArgs", "AgentTarget",
    "AgentsUpdateArgs", "AgentsDeleteArgs", "PresenceSetArgs", "TypingSetArgs",
    "PRESENCE_STATUSES", "StorageGetArgs", "StoragePutArgs", "compact_json",
    "ObserverFrame", "ObserverEmitArgs", "LivenessPingArgs",
    # responses
    "Verdict", "encode_response", "mark_replayed", "parse_response", "Response", "Outcome",
    "Event", "PublishOutcome", "ReadOutcome", "StorageAddressOutcome", "AgentsCreateOutcome",
    "AgentsUpdateOutcome", "AgentsDeleteOutcome", "StorageGetOutcome", "ObserverEmitOutcome",
    # a read page's size (the host cuts by it; the client bounds its answers' values by it)
    "page_bytes", "page_values", "event_values_in", "values_in", "MAX_PAGE_VALUES",
    # strict JSON (the wire's reader, for tools that read JSON as the host does)
    "parse_json", "JsonSyntaxError",
    # identities
    "normalize_channel_id", "normalize_hex64", "is_valid_pubkey", "is_request_id",
    # text
    "WHITE_SPACE", "trim", "scrub_line", "printable", "printable_json", "printable_json_text",
    # limits
    "PROTOCOL_VERSION", "ACTION_VERSION", "MAX_REQUEST_ID_BYTES", "MAX_CURSOR_BYTES",
    "MAX_CONTENT_BYTES", "MAX_MENTIONS", "MIN_LIMIT", "MAX_LIMIT", "DEFAULT_LIMIT",
    "MAX_DISPLAY_NAME_CHARS", "MAX_ABOUT_CHARS", "MAX_PICTURE_CHARS", "MAX_SYSTEM_PROMPT_CHARS",
    "MAX_SCALAR_CHARS", "MAX_REACTION_CHARS", "MAX_SLUG_BYTES", "MAX_SLUG_SEGMENT_CHARS",
    "MAX_NESTING", "MIN_JSON_INT",
    "MAX_JSON_INT", "MAX_KIND", "MAX_MEMORY_BODY_BYTES", "MAX_FRAMES", "MAX_OBSERVER_BYTES",
    "MAX_U32", "MAX_PAGE_BYTES", "MAX_ENCODED_EVENT_BYTES",
]
