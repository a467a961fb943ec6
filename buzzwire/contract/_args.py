"""The argument shapes of spec §Operations (NIP-BA's actions), each a frozen, slotted, keyword-only value.

Rules:
- Field names are the snake_case of the wire names. An absent optional member is `None`
  (arrays: `()`, mentionsOnly: `False`), and is omitted again when written.
- Normalization happens on the way in (`_shapes.read_object`); a constructed value must
  already be canonical, and `__post_init__` refuses anything else with ValueError.
- Trimming: every string is trimmed of Unicode White_Space (`_text.trim`) and must be
  non-empty afterwards, except `content` (published exactly as written, but holding a
  character outside White_Space, at most 64 KiB of UTF-8) and `cursor` (opaque, shape only).
- Characters (a host rule, docs/protocol.md "Text an operator reads"): the one-line
  scalars (displayName, target name, runtime, provider, model, picture, reaction) hold no
  control, line separator or bidi override; the prose (systemPrompt, about) holds no
  control but TAB, LF, CR; `content` is refused nothing (`_text` says why).
- Mentions: each is normalized to lowercase and must be an x-only secp256k1 point; at most
  50 as sent; a repeated mention is kept once, at its first position (the relay side
  de-duplicates `p` tags anyway, buzz-on-the-relay.md "The nine operations", so a repeat
  carries no meaning and refusing it would only punish sloppy callers).
- storage.put: `value` is kept exactly (never trimmed, not whitespace-only), and the whole
  compact body it becomes (`StoragePutArgs.body`) is at most 65,535 bytes (NIP-BA Memory).
- At-least-one rules: profile.set needs one member; agents.update needs one member
  besides `target`; `target` holds exactly one of `pubkey` | `name`.

WARNING: each class below must have its table registered right after it, and the tables
are the source of `ActionSpec.arg_members`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from ._ids import boolean, channel_id, cursor, exact_text, hex64, integer, pubkey, slug, text
from ._limits import (
    DEFAULT_LIMIT, MAX_ABOUT_CHARS, MAX_CONTENT_BYTES, MAX_DISPLAY_NAME_CHARS, MAX_FRAMES,
    MAX_LIMIT, MAX_MEMORY_BODY_BYTES, MAX_MENTIONS, MAX_OBSERVER_BYTES, MAX_PICTURE_CHARS,
    MAX_REACTION_CHARS, MAX_SCALAR_CHARS, MAX_SYSTEM_PROMPT_CHARS, MIN_LIMIT,
)
from ._rules import Rule
from ._shapes import Checked, Field, Shape, array_of, nested, one_of, register
from ._text import TextKind

__all__ = [
    "ChannelReadArgs", "MessagePostArgs", "MessageReplyArgs", "ReactionAddArgs",
    "ProfileSetArgs", "StorageAddressArgs", "AgentsCreateArgs", "AgentTarget",
    "AgentsUpdateArgs", "AgentsDeleteArgs", "RESPOND_TO", "PresenceSetArgs", "TypingSetArgs",
    "PRESENCE_STATUSES", "StorageGetArgs", "StoragePutArgs", "compact_json", "ObserverFrame",
    "ObserverEmitArgs", "LivenessPingArgs",
]

#: spec agents.create: the two respondTo modes (no allow-list mode exists).
RESPOND_TO = ("owner-only", "anyone")

#: NIP-BA presence.set: the three statuses (published as the kind 20001 content).
PRESENCE_STATUSES = ("online", "away", "offline")

_CHANNEL = Field("channelId", "channel_id", channel_id, required=True)
_CONTENT = Field("content", "content", exact_text(MAX_CONTENT_BYTES), required=True)
_MENTIONS = Field(
    "mentions", "mentions",
    array_of(pubkey, max_items=MAX_MENTIONS, allow_empty=False, dedupe=True), absent=(),
)
_DISPLAY_NAME = text(MAX_DISPLAY_NAME_CHARS)
_PROMPT = text(MAX_SYSTEM_PROMPT_CHARS, TextKind.PROSE)
_SCALAR = text(MAX_SCALAR_CHARS)
_RESPOND_TO = one_of(*RESPOND_TO)


@dataclass(frozen=True, slots=True, kw_only=True)
class ChannelReadArgs(Checked):
    channel_id: str
    root_event_id: str | None = None
    mentions_only: bool = False
    cursor: str | None = None
    limit: int | None = None

    @property
    def effective_limit(self) -> int:
        """The page size the response is held to: `limit`, or the default 100 when absent."""
        return DEFAULT_LIMIT if self.limit is None else self.limit


register(Shape(ChannelReadArgs, (
    _CHANNEL,
    Field("rootEventId", "root_event_id", hex64),
    Field("mentionsOnly", "mentions_only", boolean, absent=False),
    Field("cursor", "cursor", cursor),
    Field("limit", "limit", integer(MIN_LIMIT, MAX_LIMIT)),
)))


@dataclass(frozen=True, slots=True, kw_only=True)
class MessagePostArgs(Checked):
    channel_id: str
    content: str
    mentions: tuple[str, ...] = ()


register(Shape(MessagePostArgs, (_CHANNEL, _CONTENT, _MENTIONS)))


@dataclass(frozen=True, slots=True, kw_only=True)
class MessageReplyArgs(Checked):
    channel_id: str
    reply_to_event_id: str
    content: str
    mentions: tuple[str, ...] = ()


register(Shape(MessageReplyArgs, (
    _CHANNEL, Field("replyToEventId", "reply_to_event_id", hex64, required=True), _CONTENT, _MENTIONS,
)))


@dataclass(frozen=True, slots=True, kw_only=True)
class ReactionAddArgs(Checked):
    channel_id: str
    target_event_id: str
    reaction: str


register(Shape(ReactionAddArgs, (
    _CHANNEL,
    Field("targetEventId", "target_event_id", hex64, required=True),
    Field("reaction", "reaction", text(MAX_REACTION_CHARS), required=True),
)))


def _at_least_one(present: Mapping[str, object]) -> Rule | None:
    return None if present else Rule.AT_LEAST_ONE


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileSetArgs(Checked):
    display_name: str | None = None
    about: str | None = None
    picture: str | None = None


register(Shape(ProfileSetArgs, (
    Field("displayName", "display_name", _DISPLAY_NAME),
    Field("about", "about", text(MAX_ABOUT_CHARS, TextKind.PROSE)),
    Field("picture", "picture", text(MAX_PICTURE_CHARS)),
), _at_least_one))


@dataclass(frozen=True, slots=True, kw_only=True)
class StorageAddressArgs(Checked):
    slug: str


_SLUG = Field("slug", "slug", slug, required=True)
register(Shape(StorageAddressArgs, (_SLUG,)))


def compact_json(value: object) -> bytes:
    """NIP-BA's compact encoding, the one its size rules measure: members in the order
    given, no insignificant whitespace, non-ASCII literal, `\\"` `\\\\` `\\b` `\\t` `\\n` `\\f`
    `\\r` and lowercase `\\u00xx` for the other controls, `/` not escaped. Python's compact,
    non-ASCII-escaping `json.dumps` writes exactly that (tests/contract pin it)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


@dataclass(frozen=True, slots=True, kw_only=True)
class StorageGetArgs(Checked):
    slug: str


register(Shape(StorageGetArgs, (_SLUG,)))


@dataclass(frozen=True, slots=True, kw_only=True)
class StoragePutArgs(Checked):
    slug: str
    #: kept exactly as sent (NIP-BA: storage `value` is not trimmed), not whitespace-only
    value: str

    def body(self) -> bytes:
        """The record body NIP-BA fixes: exactly {"slug":s,"value":v}, or core's
        {"slug":"core","profile":v}, compact."""
        return _body(self.slug, self.value)


def _body(slug_text: str, value: str) -> bytes:
    member = "profile" if slug_text == "core" else "value"
    return compact_json({"slug": slug_text, member: value})


def _body_fits(present: Mapping[str, object]) -> Rule | None:
    slug_text, value = present.get("slug"), present.get("value")
    if not isinstance(slug_text, str) or not isinstance(value, str):
        return None  # a missing member was already refused
    if len(_body(slug_text, value)) > MAX_MEMORY_BODY_BYTES:
        return Rule.RECORD_BODY
    return None


register(Shape(StoragePutArgs, (
    _SLUG, Field("value", "value", exact_text(MAX_MEMORY_BODY_BYTES), required=True),
), _body_fits))

# agents.create / agents.update share these optional members (spec agents.create).
_AGENT_OPTIONALS = (
    Field("runtime", "runtime", _SCALAR),
    Field("provider", "provider", _SCALAR),
    Field("model", "model", _SCALAR),
    Field("respondTo", "respond_to", _RESPOND_TO),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentsCreateArgs(Checked):
    channel_id: str
    display_name: str
    system_prompt: str
    runtime: str | None = None
    provider: str | None = None
    model: str | None = None
    respond_to: str | None = None


register(Shape(AgentsCreateArgs, (
    _CHANNEL,
    Field("displayName", "display_name", _DISPLAY_NAME, required=True),
    Field("systemPrompt", "system_prompt", _PROMPT, required=True),
    *_AGENT_OPTIONALS,
)))


def _exactly_one(present: Mapping[str, object]) -> Rule | None:
    return None if len(present) == 1 else Rule.ONE_TARGET


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentTarget(Checked):
    pubkey: str | None = None
    name: str | None = None


_TARGET_SHAPE = register(Shape(AgentTarget, (
    Field("pubkey", "pubkey", pubkey),
    Field("name", "name", _DISPLAY_NAME),
), _exactly_one))
_TARGET = Field("target", "target", nested(lambda: _TARGET_SHAPE), required=True)


def _beyond_target(present: Mapping[str, object]) -> Rule | None:
    return None if len(present) > 1 else Rule.AT_LEAST_ONE_BESIDES_TARGET


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentsUpdateArgs(Checked):
    target: AgentTarget
    display_name: str | None = None
    system_prompt: str | None = None
    runtime: str | None = None
    provider: str | None = None
    model: str | None = None
    respond_to: str | None = None


register(Shape(AgentsUpdateArgs, (
    _TARGET,
    Field("displayName", "display_name", _DISPLAY_NAME),
    Field("systemPrompt", "system_prompt", _PROMPT),
    *_AGENT_OPTIONALS,
), _beyond_target))


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentsDeleteArgs(Checked):
    target: AgentTarget


register(Shape(AgentsDeleteArgs, (_TARGET,)))


# NIP-BA "Live signals": presence.set and typing.set. The status is read like respondTo (a
# trimmed choice among fixed words); typing names only its channel.


@dataclass(frozen=True, slots=True, kw_only=True)
class PresenceSetArgs(Checked):
    status: str


register(Shape(PresenceSetArgs, (
    Field("status", "status", one_of(*PRESENCE_STATUSES), required=True),
)))


@dataclass(frozen=True, slots=True, kw_only=True)
class TypingSetArgs(Checked):
    channel_id: str


register(Shape(TypingSetArgs, (_CHANNEL,)))
# --- observer.emit and liveness.ping (NIP-BA "Live signals", issue 23 items 3-4) ---------


@dataclass(frozen=True, slots=True, kw_only=True)
class ObserverFrame(Checked):
    """One observer frame: `kind` is the runtime's discriminator (not a Nostr kind), a
    trimmed scalar; `payload` is opaque and kept byte for byte (NIP-BA: not trimmed, but
    it must hold a non-whitespace character)."""

    kind: str
    payload: str


_FRAME_SHAPE = register(Shape(ObserverFrame, (
    Field("kind", "kind", _SCALAR, required=True),
    Field("payload", "payload", exact_text(MAX_OBSERVER_BYTES), required=True),
)))


def _frames_fit(present: Mapping[str, object]) -> Rule | None:
    # NIP-BA "Live signals": the whole normalized {"frames":[{"kind":k,"payload":p},...]}
    # is at most 65,535 bytes under the compact-encoding rule. Normalized: the kinds as
    # trimmed, which is what `present` holds.
    frames = present.get("frames")
    if not isinstance(frames, tuple):
        return None  # required member: its absence is reported before the rule runs
    wire = {"frames": [{"kind": f.kind, "payload": f.payload} for f in frames
                       if isinstance(f, ObserverFrame)]}
    if len(compact_json(wire)) > MAX_OBSERVER_BYTES:
        return Rule.FRAMES_BODY
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class ObserverEmitArgs(Checked):
    frames: tuple[ObserverFrame, ...]


register(Shape(ObserverEmitArgs, (
    Field("frames", "frames",
          array_of(nested(lambda: _FRAME_SHAPE), max_items=MAX_FRAMES, allow_empty=False),
          required=True),
), _frames_fit))


@dataclass(frozen=True, slots=True, kw_only=True)
class LivenessPingArgs(Checked):
    """liveness.ping: the session's channel and the runtime's process-local turn id."""

    channel_id: str
    turn_id: str


register(Shape(LivenessPingArgs, (
    _CHANNEL,
    Field("turnId", "turn_id", _SCALAR, required=True),
)))
