"""Outcome shapes (spec §Operations) and the strict seven-member signed event (I4).

Rules:
- Outcomes echo identities in canonical form (channel ids lowercase hyphenated, pubkeys
  and ids lowercase); pubkeys must be secp256k1 points.
- `Event` is held to exactly id, pubkey, created_at, kind, tags, content, sig. Its fields
  are verbatim signed data, so nothing is rewritten: ids and pubkeys must already be
  lowercase hex, sig 128 lowercase hex. Whether the signature verifies is the reader's
  policy (buzzwire.nostr.verify_event), not this module's.
- `ReadOutcome.messages` is required and may be empty (an empty page is a fact, not an
  absent member); it never holds more than MAX_LIMIT events. `nextCursor` is omitted when
  there is nothing further.
- The agents.* outcomes are spelled as Buzz pins them (shared/spec/wire-schema.md):
  `agentPubkey`, `displayName` (and `updatedFields` for agents.update), never `pubkey`/`name`.
- `AgentsUpdateOutcome.updated_fields` is required and may be empty (an update that
  changed nothing); per spec the client checks the entries are strings and nothing more.

WARNING: the tables registered here are the source of `ActionSpec.outcome_members`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ._ids import (
    any_string, channel_id, cursor, hex64, integer, lower_hex64_exact, lower_hex128_exact,
    pubkey, text,
)
from ._limits import MAX_DISPLAY_NAME_CHARS, MAX_KIND, MAX_LIMIT, MAX_U32
from ._shapes import Checked, Field, Shape, array_of, nested, read_object, register, to_wire

__all__ = [
    "Event", "PublishOutcome", "ReadOutcome", "StorageAddressOutcome", "AgentsCreateOutcome",
    "AgentsUpdateOutcome", "AgentsDeleteOutcome", "Outcome", "StorageGetOutcome",
    "ObserverEmitOutcome",
]

_KIND = integer(0, MAX_KIND)
_TIMESTAMP = integer(0)
_NAME = text(MAX_DISPLAY_NAME_CHARS)


@dataclass(frozen=True, slots=True, kw_only=True)
class Event(Checked):
    """A signed Nostr event exactly as the relay holds it (NIP-01's seven members).

    Attributes:
        id: the event id, 64 lowercase hex (sha256 of the NIP-01 serialization).
        pubkey: the author, 64 lowercase hex.
        created_at: Unix seconds, as signed.
        kind: the event kind (9 a message, 7 a reaction, ...).
        tags: the tags, each a tuple of strings (`h` channel, `e` ancestry, `p` mentions).
        content: the text, verbatim.
        sig: the BIP-340 signature, 128 lowercase hex.
    """

    id: str
    pubkey: str
    created_at: int
    kind: int
    tags: tuple[tuple[str, ...], ...]
    content: str
    sig: str

    @classmethod
    def from_json_obj(cls, obj: Mapping[str, object]) -> Event:
        """Strict: exactly the seven members, nothing null, nothing rewritten.

        Raises:
            ContractError: invalid_request with the pointer (relative to the event).
        """
        return read_object(dict(obj) if type(obj) is not dict else obj, "", _EVENT_SHAPE)

    def to_json_obj(self) -> dict[str, object]:
        """The seven members as plain JSON values (tags as lists)."""
        return to_wire(self)


_EVENT_SHAPE = register(Shape(Event, (
    Field("id", "id", lower_hex64_exact, required=True),
    Field("pubkey", "pubkey", lower_hex64_exact, required=True),
    Field("created_at", "created_at", _TIMESTAMP, required=True),
    Field("kind", "kind", _KIND, required=True),
    Field("tags", "tags", array_of(array_of(any_string, allow_empty=True), allow_empty=True), required=True),
    Field("content", "content", any_string, required=True),
    Field("sig", "sig", lower_hex128_exact, required=True),
)))


@dataclass(frozen=True, slots=True, kw_only=True)
class PublishOutcome(Checked):
    """message.post, message.reply, reaction.add, profile.set, storage.put and the live
    signals: the event the host signed.

    Attributes:
        event_id: its id, 64 lowercase hex.
        kind: its kind (9, 7, 0, 30174, 20001, 20002).
        created_at: its timestamp, Unix seconds, chosen by the host.
    """

    event_id: str
    kind: int
    created_at: int


register(Shape(PublishOutcome, (
    Field("eventId", "event_id", hex64, required=True),
    Field("kind", "kind", _KIND, required=True),
    Field("createdAt", "created_at", _TIMESTAMP, required=True),
)))


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadOutcome(Checked):
    """channel.read: one page.

    Attributes:
        messages: the page's signed events, newest first, at most the request's limit.
        next_cursor: the opaque cursor of the next (older) page, None on the last page.
    """

    messages: tuple[Event, ...]
    next_cursor: str | None = None


register(Shape(ReadOutcome, (
    Field("messages", "messages",
          array_of(nested(lambda: _EVENT_SHAPE), max_items=MAX_LIMIT, allow_empty=True), required=True),
    Field("nextCursor", "next_cursor", cursor),
)))


@dataclass(frozen=True, slots=True, kw_only=True)
class StorageAddressOutcome(Checked):
    """storage.address: where a memory record lives (NIP-AE).

    Attributes:
        author_pubkey: the record's author: this agent's own pubkey.
        kind: the record's kind, 30174.
        d_tag: its blinded `d` tag, 64 lowercase hex.
    """

    author_pubkey: str
    kind: int
    d_tag: str


register(Shape(StorageAddressOutcome, (
    Field("authorPubkey", "author_pubkey", pubkey, required=True),
    Field("kind", "kind", _KIND, required=True),
    Field("dTag", "d_tag", hex64, required=True),
)))


@dataclass(frozen=True, slots=True, kw_only=True)
class StorageGetOutcome(Checked):
    """storage.get: the record's `value` (core's `profile`); absent for no record or a
    tombstone (`{}`). An existing empty string is `{"value":""}` (NIP-BA Memory).

    Attributes:
        value: the decrypted text, or None when there is no record.
    """

    value: str | None = None


register(Shape(StorageGetOutcome, (Field("value", "value", any_string),)))


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentsCreateOutcome(Checked):
    """agents.create: the new agent's public identity (its key stays in custody).

    Attributes:
        agent_pubkey: its pubkey, 64 lowercase hex.
        display_name: its name.
        channel_id: the channel it joined, canonical UUID.
    """

    agent_pubkey: str
    display_name: str
    channel_id: str


register(Shape(AgentsCreateOutcome, (
    Field("agentPubkey", "agent_pubkey", pubkey, required=True),
    Field("displayName", "display_name", _NAME, required=True),
    Field("channelId", "channel_id", channel_id, required=True),
)))


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentsUpdateOutcome(Checked):
    """agents.update: the agent patched.

    Attributes:
        agent_pubkey: its pubkey, 64 lowercase hex.
        display_name: its name after the patch.
        updated_fields: the wire names changed, sorted; empty for a no-op patch.
    """

    agent_pubkey: str
    display_name: str
    updated_fields: tuple[str, ...]


register(Shape(AgentsUpdateOutcome, (
    Field("agentPubkey", "agent_pubkey", pubkey, required=True),
    Field("displayName", "display_name", _NAME, required=True),
    Field("updatedFields", "updated_fields", array_of(any_string, allow_empty=True), required=True),
)))


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentsDeleteOutcome(Checked):
    """agents.delete: the agent removed.

    Attributes:
        agent_pubkey: its pubkey, 64 lowercase hex.
        display_name: the name it had.
    """

    agent_pubkey: str
    display_name: str


register(Shape(AgentsDeleteOutcome, (
    Field("agentPubkey", "agent_pubkey", pubkey, required=True),
    Field("displayName", "display_name", _NAME, required=True),
)))

@dataclass(frozen=True, slots=True, kw_only=True)
class ObserverEmitOutcome(Checked):
    """observer.emit: how many frames the host took in for best-effort publication (NIP-BA:
    a count, 0 through the frames sent, not a list; the client checks the upper bound).

    Attributes:
        accepted: how many frames the host took in.
    """

    accepted: int


register(Shape(ObserverEmitOutcome, (
    Field("accepted", "accepted", integer(0, MAX_U32), required=True),
)))

Outcome = (
    PublishOutcome | ReadOutcome | StorageAddressOutcome | AgentsCreateOutcome
    | AgentsUpdateOutcome | AgentsDeleteOutcome | StorageGetOutcome | ObserverEmitOutcome
)
