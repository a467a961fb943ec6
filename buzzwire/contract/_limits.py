"""Every numeric limit of the wire contract, each with its source.

Rules: one named constant per limit; the validators import these and never spell a number.
Characters are Unicode scalar values (Python `len(str)`); bytes are UTF-8 bytes.

WARNING: docs/configuration.md derives the default `max_body_bytes` (512 KiB) from
MAX_CONTENT_BYTES (64 KiB of content, JSON-escaped up to 6x, plus the envelope); a larger
content limit means re-deriving it (daemon/config.py `_KEYS`).
"""

from __future__ import annotations

from buzzwire import kinds

__all__ = [
    "MAX_REQUEST_ID_BYTES", "MAX_CURSOR_BYTES", "MAX_CONTENT_BYTES", "MAX_MENTIONS",
    "MIN_LIMIT", "MAX_LIMIT", "DEFAULT_LIMIT", "MAX_DISPLAY_NAME_CHARS", "MAX_ABOUT_CHARS",
    "MAX_PICTURE_CHARS", "MAX_SYSTEM_PROMPT_CHARS", "MAX_SCALAR_CHARS", "MAX_REACTION_CHARS",
    "MAX_SLUG_BYTES", "MAX_SLUG_SEGMENT_CHARS", "MAX_NESTING", "MIN_JSON_INT", "MAX_JSON_INT",
    "MAX_KIND", "PROTOCOL_VERSION", "ACTION_VERSION", "MAX_MEMORY_BODY_BYTES", "MAX_FRAMES",
    "MAX_OBSERVER_BYTES", "MAX_U32", "MAX_U16", "MAX_PAGE_BYTES", "MAX_ENCODED_EVENT_BYTES",
]

#: spec §Request: the envelope version this module speaks.
PROTOCOL_VERSION = 1
#: spec §Operations: all nine operations are at actionVersion 1.
ACTION_VERSION = 1
#: spec §Request: requestId is 1–128 bytes of printable ASCII without spaces.
MAX_REQUEST_ID_BYTES = 128
#: spec channel.read: a cursor is 1–256 bytes of printable ASCII without spaces.
MAX_CURSOR_BYTES = 256
#: spec message.post: content at most 64 KiB, counted in UTF-8 bytes.
MAX_CONTENT_BYTES = 64 * 1024
#: spec message.post: at most 50 mentions (counted as sent, before de-duplication).
MAX_MENTIONS = 50
#: spec channel.read: limit is 1–500; absent means the host's default page of 100.
MIN_LIMIT = 1
MAX_LIMIT = 500
DEFAULT_LIMIT = 100
#: spec profile.set / agents.create: names are at most 120 characters.
MAX_DISPLAY_NAME_CHARS = 120
#: spec profile.set: the blurb is at most 2,000 characters.
MAX_ABOUT_CHARS = 2000
#: spec profile.set: the picture URL is at most 300 characters.
MAX_PICTURE_CHARS = 300
#: spec agents.create: systemPrompt is at most 20,000 characters.
MAX_SYSTEM_PROMPT_CHARS = 20_000
#: spec agents.create: runtime, provider and model are short scalars of at most 300 characters.
MAX_SCALAR_CHARS = 300
#: spec reaction.add: a reaction is non-empty and at most 66 characters.
MAX_REACTION_CHARS = 66
#: spec storage.address / NIP-AE: a slug is at most 255 bytes (ASCII grammar: bytes == chars).
MAX_SLUG_BYTES = 255
#: NIP-AE's slug grammar (buzz-on-the-relay.md "Encrypted memory address"): each segment
#: after ``mem/`` is ``[a-z0-9][a-z0-9_-]{0,63}``, at most 64 characters.
MAX_SLUG_SEGMENT_CHARS = 64
#: NIP-BA storage.put / NIP-AE Writing: the compact UTF-8 body {"slug":s,"value":v} (or
#: core's {"slug":"core","profile":v}) is at most 65,535 bytes, the NIP-44 plaintext cap.
MAX_MEMORY_BODY_BYTES = 65_535
#: Our bound on one channel.read page, in `page_bytes` (contract `_page`: content and tag
#: strings, and a fixed allowance for the rest): 500 events of 8 KiB each, or 64 of the
#: largest content (64 KiB). Past it the host ends the page early with a `nextCursor`, as
#: the spec allows; the agent client's bound on an answer's JSON values derives from it.
MAX_PAGE_BYTES = 4 * 1024 * 1024
#: The largest event a channel.read answer carries, as its compact UTF-8 JSON is sent (no
#: escape but JSON's own). Buzz's SDK refuses a whole read answer holding one larger
#: message (buzz-sdk `MAX_ENCODED_MESSAGE_BYTES`), the size of a frame on Buzz's relay
#: (../shared/spec/buzz-on-the-relay.md "Relay-side limits": frames up to 512 KiB). A
#: channel member can still publish a larger event to some relay; the host drops it from
#: reads (daemon/operations/channel_read.py `_size_ok`) so the channel stays readable.
MAX_ENCODED_EVENT_BYTES = 512 * 1024
#: Our bound on container nesting. The deepest legal document is a read response:
#: top / outcome / messages / event / tags / tag = 6 levels. 16 leaves room and keeps a
#: hostile 10,000-deep body far from the C decoder's recursion.
MAX_NESTING = 16
#: Our bound on any JSON integer: signed 64-bit. Nothing in the protocol needs more, and a
#: 4,000-digit number is a denial-of-service vector, not a value.
MIN_JSON_INT = -(2**63)
MAX_JSON_INT = 2**63 - 1
MAX_KIND = kinds.MAX
#: NIP-BA "Live signals": observer.emit carries 1-256 frames.
MAX_FRAMES = 256
#: NIP-BA "Live signals": each observer payload, and the whole compact
#: `{"frames":[...]}` (NIP-BA's compact-encoding rule), is at most 65,535 bytes of UTF-8.
MAX_OBSERVER_BYTES = 65_535
#: NIP-BA "Wire and normalization": counts are u32.
MAX_U32 = 2**32 - 1
#: NIP-BA "Wire and normalization": version fields are u16 (nonnegative); -1 or 65,536 is
#: not a version at all, so it is malformed (invalid_request), not an unsupported version.
MAX_U16 = 2**16 - 1
