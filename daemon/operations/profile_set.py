"""profile.set: merge into the requester's own kind-0 profile and republish it.

Steps (buzz-on-the-relay.md): read the current kind 0, merge the members given, keep every
member the host does not set (`nip05`, `lud16`, …), republish. `displayName` writes both
`display_name` and `name`, as Buzz's clients read either. A current profile whose content
is not a JSON object is replaced, with a log line. The new version's created_at is after
the old one's (replaceable events keep the lowest id within one second). The pipeline
serializes this operation per agent, so two merges cannot race.
"""

from __future__ import annotations

import json
import logging

from buzzwire import kinds
from buzzwire.contract import ProfileSetArgs, PublishOutcome
from buzzwire.nostr import SignedEvent
from daemon.log import log_event
from daemon.operations._base import Context, Plan
from daemon.operations._events import (
    check_builds_on_latest,
    fetch,
    json_object_or_none,
    newest,
    next_created_at,
    sign,
)

_log = logging.getLogger("buzz_broker.operations")

#: NIP-01 user metadata (replaceable).
KIND_METADATA = kinds.METADATA

#: wire member -> the kind-0 JSON members it sets.
PROFILE_MEMBERS: dict[str, tuple[str, ...]] = {
    "display_name": ("display_name", "name"),
    "about": ("about",),
    "picture": ("picture",),
}


async def current_profile(
    ctx: Context, author: str
) -> tuple[dict[str, object], SignedEvent | None]:
    """The author's newest kind 0 and its content (empty when absent or corrupt)."""
    found = await fetch(ctx, {"kinds": [KIND_METADATA], "authors": [author], "limit": 5})
    previous = newest([e for e in found if e.pubkey == author and e.kind == KIND_METADATA])
    check_builds_on_latest(ctx, author, KIND_METADATA, "", previous)
    if previous is None:
        return {}, None
    content = json_object_or_none(previous.content)
    if content is None:
        log_event(_log, "profile.corrupt_replaced", agent=author, event_id=previous.id)
        return {}, previous
    return content, previous


async def prepare(ctx: Context, args: ProfileSetArgs) -> Plan:
    agent = ctx.principal.agent
    content, previous = await current_profile(ctx, agent)
    for field, members in PROFILE_MEMBERS.items():
        value = getattr(args, field)
        if value is not None:
            for member in members:
                content[member] = value
    event = await sign(
        ctx,
        agent,
        KIND_METADATA,
        [],
        json.dumps(content, ensure_ascii=False, separators=(",", ":")),
        created_at=next_created_at(ctx.now(), previous),
    )
    return Plan(
        events=(event,),
        outcome=PublishOutcome(
            event_id=event.id, kind=event.kind, created_at=event.created_at
        ),
    )
