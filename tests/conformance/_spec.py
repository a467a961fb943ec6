"""The spec's tables, transcribed by hand from agent-broker.md and buzz-on-the-relay.md.

Rules: nothing here is imported from `daemon` — a table copied from the code under review
would agree with it by construction. Each table names the spec section it comes from.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

#: §Operations: the nine wire names of version 1 (NIP-BA's six more: NIP_BA_ADDED below).
ACTIONS: frozenset[str] = frozenset({
    "channel.read", "message.post", "message.reply", "reaction.add", "profile.set",
    "storage.address", "agents.create", "agents.update", "agents.delete",
})

#: §Operations "Reserved against" (sign, publish, encrypt, decrypt, relay authentication):
#: none may resolve. (agent-broker.md deferred presence.set and typing.set; NIP-BA, which is
#: stricter and later, defines them, so they left this list: see docs/protocol.md.)
NEVER_RESOLVE: tuple[str, ...] = (
    "sign", "publish", "encrypt", "decrypt", "auth", "authenticate", "relay.auth",
    "Presence.Set", "typing_set", "Message.Post", "message_post", "message.delete",
)

#: §Request: exactly these six members.
REQUEST_MEMBERS: frozenset[str] = frozenset({
    "type", "protocolVersion", "requestId", "actionVersion", "action", "args"})

#: §Results: the member set per status (`replayed` is the one optional addition).
SUCCEEDED_MEMBERS: frozenset[str] = frozenset({
    "type", "protocolVersion", "requestId", "status", "action", "outcome"})
ERROR_MEMBERS: frozenset[str] = frozenset({"type", "protocolVersion", "requestId", "status", "error"})
ERROR_OBJECT_MEMBERS: frozenset[str] = frozenset({"code", "message"})

#: §Results "The complete table": code -> statuses it may travel with.
PAIRING: Mapping[str, frozenset[str]] = MappingProxyType({
    "invalid_request": frozenset({"failed"}),
    "unsupported_protocol_version": frozenset({"failed"}),
    "unknown_action": frozenset({"failed"}),
    "unsupported_action_version": frozenset({"failed"}),
    "unsupported": frozenset({"failed"}),
    "unauthenticated": frozenset({"failed"}),
    "unauthorized": frozenset({"failed"}),
    "request_id_conflict": frozenset({"failed"}),
    "action_failed": frozenset({"failed"}),
    "outcome_unknown": frozenset({"indeterminate"}),
    "internal": frozenset({"failed", "indeterminate"}),
})

_PUBLISH: tuple[frozenset[str], frozenset[str]] = (
    frozenset({"eventId", "kind", "createdAt"}), frozenset())

#: §Operations: each outcome's (required, optional) members.
OUTCOME_MEMBERS: Mapping[str, tuple[frozenset[str], frozenset[str]]] = MappingProxyType({
    "channel.read": (frozenset({"messages"}), frozenset({"nextCursor"})),
    "message.post": _PUBLISH,
    "message.reply": _PUBLISH,
    "reaction.add": _PUBLISH,
    "profile.set": _PUBLISH,
    "storage.address": (frozenset({"authorPubkey", "kind", "dTag"}), frozenset()),
    # NIP-BA Memory
    "agents.create": (frozenset({"agentPubkey", "displayName", "channelId"}), frozenset()),
    "agents.update": (frozenset({"agentPubkey", "displayName", "updatedFields"}), frozenset()),
    "agents.delete": (frozenset({"agentPubkey", "displayName"}), frozenset()),
})

#: I4: the canonical seven members of every returned event.
EVENT_MEMBERS: frozenset[str] = frozenset({"id", "pubkey", "created_at", "kind", "tags", "content", "sig"})

#: Arrays that are *required* members, where `[]` is a fact and not a second spelling of
#: absence (I6 speaks of optional members): an event's signed `tags` (the spec's own
#: example shows `"tags": []`), a page's `messages`, and `updatedFields`.
REQUIRED_ARRAYS: frozenset[str] = frozenset({"tags", "messages", "updatedFields"})

#: channel.read: "absent means the host's default page of 100"; limit is 1-500.
DEFAULT_PAGE = 100
MAX_LIMIT = 500
#: message.post: content at most 64 KiB (bytes).
MAX_CONTENT_BYTES = 64 * 1024

#: buzz-on-the-relay.md "Channels": the message kinds a channel read may return.
READ_KINDS: frozenset[int] = frozenset({9, 40002, 40008, 45001, 45003})

#: buzz-on-the-relay.md "Managed agents" / wire-schema.md: the 30177 content members
#: (Buzz's `ManagedAgentEventContent`), and what it must never carry.
RECORD_REQUIRED: frozenset[str] = frozenset({"name", "parallelism", "respond_to"})
RECORD_OPTIONAL: frozenset[str] = frozenset({
    "persona_id", "system_prompt", "model", "provider", "persona_source_version",
    "respond_to_allowlist"})
RECORD_NEVER: frozenset[str] = frozenset({"runtime"})

#: buzz-on-the-relay.md "Ownership tag": the preimage prefix of a NIP-OA signature.
NIP_OA_PREFIX = "nostr:agent-auth:"


# --- NIP-BA (block/buzz docs/nips/NIP-BA.md, read at a7beb19), transcribed by hand -------

#: NIP-BA "Actions": the fifteen names, in its table's order.
NIP_BA_ACTIONS: tuple[str, ...] = (
    "channel.read", "message.post", "message.reply", "reaction.add", "profile.set",
    "storage.address", "storage.get", "storage.put", "presence.set", "typing.set",
    "observer.emit", "liveness.ping", "agents.create", "agents.update", "agents.delete",
)
#: The six NIP-BA added to agent-broker.md's nine.
NIP_BA_ADDED: frozenset[str] = frozenset(NIP_BA_ACTIONS) - ACTIONS

_PUBLISHED = (frozenset({"eventId", "kind", "createdAt"}), frozenset())

#: NIP-BA "Actions", "Exact outcome" column: (required, optional) members.
NIP_BA_OUTCOMES: Mapping[str, tuple[frozenset[str], frozenset[str]]] = MappingProxyType({
    "channel.read": (frozenset({"messages"}), frozenset({"nextCursor"})),
    "message.post": _PUBLISHED, "message.reply": _PUBLISHED, "reaction.add": _PUBLISHED,
    "profile.set": _PUBLISHED,
    "storage.address": (frozenset({"authorPubkey", "kind", "dTag"}), frozenset()),
    "storage.get": (frozenset(), frozenset({"value"})),
    "storage.put": _PUBLISHED, "presence.set": _PUBLISHED, "typing.set": _PUBLISHED,
    "observer.emit": (frozenset({"accepted"}), frozenset()),
    "liveness.ping": _PUBLISHED,
    "agents.create": (frozenset({"agentPubkey", "displayName", "channelId"}), frozenset()),
    "agents.update": (frozenset({"agentPubkey", "displayName", "updatedFields"}), frozenset()),
    "agents.delete": (frozenset({"agentPubkey", "displayName"}), frozenset()),
})

#: NIP-BA "Actions", "Exact args" column: (required, optional) members.
NIP_BA_ARGS: Mapping[str, tuple[frozenset[str], frozenset[str]]] = MappingProxyType({
    "channel.read": (frozenset({"channelId"}),
                     frozenset({"rootEventId", "mentionsOnly", "cursor", "limit"})),
    "message.post": (frozenset({"channelId", "content"}), frozenset({"mentions"})),
    "message.reply": (frozenset({"channelId", "content", "replyToEventId"}), frozenset({"mentions"})),
    "reaction.add": (frozenset({"channelId", "targetEventId", "reaction"}), frozenset()),
    "profile.set": (frozenset(), frozenset({"displayName", "about", "picture"})),
    "storage.address": (frozenset({"slug"}), frozenset()),
    "storage.get": (frozenset({"slug"}), frozenset()),
    "storage.put": (frozenset({"slug", "value"}), frozenset()),
    "presence.set": (frozenset({"status"}), frozenset()),
    "typing.set": (frozenset({"channelId"}), frozenset()),
    "observer.emit": (frozenset({"frames"}), frozenset()),
    "liveness.ping": (frozenset({"channelId", "turnId"}), frozenset()),
    "agents.create": (frozenset({"channelId", "displayName", "systemPrompt"}),
                      frozenset({"runtime", "provider", "model", "respondTo"})),
    "agents.update": (frozenset({"target"}), frozenset({
        "displayName", "systemPrompt", "runtime", "provider", "model", "respondTo"})),
    "agents.delete": (frozenset({"target"}), frozenset()),
})

#: The Nostr kind each Published action builds (NIP-BA "Channel and messages", "Memory",
#: "Live signals"; kind 0 for the profile, NIP-01).
NIP_BA_KINDS: Mapping[str, int] = MappingProxyType({
    "message.post": 9, "message.reply": 9, "reaction.add": 7, "profile.set": 0,
    "storage.put": 30174, "presence.set": 20001, "typing.set": 20002, "liveness.ping": 24200,
})
#: storage.address: "returns the agent's author pubkey, kind 30174".
NIP_BA_MEMORY_KIND = 30174

#: NIP-BA "Live signals": "Reaction and all four live actions are best effort".
NIP_BA_BEST_EFFORT: frozenset[str] = frozenset({
    "reaction.add", "presence.set", "typing.set", "observer.emit", "liveness.ping"})

#: NIP-BA presence.set statuses.
NIP_BA_PRESENCE: frozenset[str] = frozenset({"online", "away", "offline"})

#: NIP-BA "Wire and normalization": integer widths.
U16, U32, U64 = 2**16 - 1, 2**32 - 1, 2**64 - 1
#: NIP-BA "Name / prompt / scalar / about" limits in Unicode scalars.
NIP_BA_NAME_CHARS = 120
#: NIP-BA update/create mutable members (updatedFields is a subset of those supplied).
NIP_BA_MUTABLE: frozenset[str] = frozenset({
    "displayName", "systemPrompt", "runtime", "provider", "model", "respondTo"})
