"""The managed-agent record (kind 30177) shared by agents.create, agents.update and agents.delete.

On the relay (buzz-on-the-relay.md "Managed agents", wire-schema.md "The managed-agent
record"): signed by the owner, `["d", agent]`, content JSON as Buzz's desktop writes it
(`ManagedAgentEventContent`): `{"name", "persona_id"?, "system_prompt"?, "model"?,
"provider"?, "persona_source_version"?, "parallelism", "respond_to",
"respond_to_allowlist"?}`. It is world-readable, so it never carries the agent's secret key,
its auth tag, env vars or runtime fields: the runtime an agent resolved to is kept in the
host's own record (daemon/state/runtimes.py), never here.

Rules:
- The owner of every record is the requester (B2): there is no owner argument anywhere.
- A target (by pubkey or by name) is resolved once, by policy's `authorize`, among the
  requester's own live agents only (an agent of another owner is refused exactly like an
  unknown one); the operation takes it from `ctx.authorized` (`target`).
- Create writes `parallelism: 1`. A republish starts from the content read: every member
  the host does not set (`persona_id`, `respond_to_allowlist`, `parallelism`, members of a
  later Buzz) is kept as read; only `runtime` is dropped (an earlier version of this host
  wrote it there).

WARNING: `RECORD_MEMBERS` and `ARG_ATTRIBUTES` must name the same wire members; the order
of `RECORD_MEMBERS` is the order `updatedFields` is computed in (then sorted).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from buzzwire import kinds
from buzzwire.contract import MAX_DISPLAY_NAME_CHARS, scrub_line, trim
from daemon.operations._base import Context
from buzzwire.nostr import SignedEvent
from daemon.pipeline.policy import AgentView

#: Buzz's managed-agent record (parameterized replaceable).
KIND_MANAGED_AGENT = kinds.MANAGED_AGENT
#: NIP-29 put-user (add a member to a group), signed by the owner.
KIND_PUT_USER = kinds.PUT_USER
#: NIP-09 deletion request.
KIND_DELETION = kinds.DELETION
#: The spec's default for an absent respondTo.
DEFAULT_RESPOND_TO = "owner-only"

#: wire member of agents.create/update -> member of the 30177 content. The order is the
#: order Buzz writes them in. `runtime` is not one: it is the host's own record.
RECORD_MEMBERS: dict[str, str] = {
    "displayName": "name",
    "systemPrompt": "system_prompt",
    "model": "model",
    "provider": "provider",
    "respondTo": "respond_to",
}

#: wire member -> attribute of the contract's argument value.
ARG_ATTRIBUTES: dict[str, str] = {
    "displayName": "display_name",
    "systemPrompt": "system_prompt",
    "model": "model",
    "provider": "provider",
    "respondTo": "respond_to",
}

#: `ManagedAgentEventContent`'s members in the order Buzz's desktop serializes them.
CONTENT_ORDER = ("name", "persona_id", "system_prompt", "model", "provider",
                 "persona_source_version", "parallelism", "respond_to", "respond_to_allowlist")
#: Members the 30177 content must never carry (Buzz's kind registry: no runtime fields).
NEVER_PUBLISHED = frozenset({"runtime"})
#: `parallelism` at create, and when a record read has none (Buzz requires the member).
DEFAULT_PARALLELISM = 1


def record_content(fields: Mapping[str, object], *, read: Mapping[str, object] | None = None
                   ) -> str:
    """The 30177 content: the record `read` (if any) with `fields` set over it.

    `fields` holds the members the host sets (None = not given). Every other member of
    `read` is kept as read, in Buzz's order and then the order read; `runtime` is dropped.
    """
    merged: dict[str, object] = {k: v for k, v in (read or {}).items() if k not in NEVER_PUBLISHED}
    for member, value in fields.items():
        if value is not None:
            merged[member] = value
    merged.setdefault("parallelism", DEFAULT_PARALLELISM)
    if not merged.get("respond_to"):
        merged["respond_to"] = DEFAULT_RESPOND_TO
    ordered = {m: merged[m] for m in CONTENT_ORDER if m in merged}
    ordered.update((k, v) for k, v in merged.items() if k not in ordered)
    return json.dumps(ordered, ensure_ascii=False, separators=(",", ":"))


def outcome_name(name: object, pubkey: str) -> str:
    """A name an outcome can carry (`displayName`: trimmed of White_Space, 1-120
    characters, encodable, no control or bidi override).

    Names come from records that may hold anything: an operator's `agent import --name`
    with padding, a restored backup, or another client's 30177 on the relay. The outcome
    must still be built (a bad name once became a bodiless 500), so the name is trimmed,
    each character a name may not hold becomes U+FFFD (`scrub_line`), it is cut to the
    limit, and the first 12 hex of the pubkey stand in for an empty one.
    """
    text = name if isinstance(name, str) else ""
    text = scrub_line(trim(text.encode("utf-8", "replace").decode("utf-8")))
    return trim(text[:MAX_DISPLAY_NAME_CHARS]) or pubkey[:12]


def is_record_of(event: SignedEvent, owner: str, agent: str) -> bool:
    """Exactly `agent`'s managed record by `owner`: kind 30177, author, and `d` tag."""
    return (
        event.kind == KIND_MANAGED_AGENT
        and event.pubkey == owner
        and event.tag_value("d") == agent
    )


def coordinate(owner: str, agent: str) -> str:
    """The NIP-01 address of an agent's managed record."""
    return f"{KIND_MANAGED_AGENT}:{owner}:{agent}"


def owned_target(ctx: Context) -> AgentView:
    """The live agent the requester owns that the request names, as authorization
    resolved it (agents.update, agents.delete)."""
    target = ctx.authorized.target
    assert target is not None, "authorize resolves the target of every target action"
    return target
