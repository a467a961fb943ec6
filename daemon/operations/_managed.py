"""The managed-agent record (kind 30177) shared by agents.create, agents.update and agents.delete.

On the relay (buzz-on-the-relay.md, "Managed agents"): signed by the owner, `["d", agent]`,
content JSON `{"name", "system_prompt"?, "model"?, "provider"?, "runtime"?, "parallelism": 1,
"respond_to"}`. It never carries the agent's secret key or its auth tag.

Rules:
- The owner of every record is the requester (B2): there is no owner argument anywhere.
- A target (by pubkey or by name) is resolved by policy among the requester's own live
  agents only; an agent of another owner is refused exactly like an unknown one.

WARNING: `RECORD_MEMBERS` and `ARG_ATTRIBUTES` must name the same wire members; the order
of `RECORD_MEMBERS` is the order `updatedFields` is computed in (then sorted).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from custody import AgentRecord
from buzzwire.contract import AgentTarget, ErrorCode
from daemon.operations._base import Context, OperationRefused
from daemon.operations._events import tag_value
from daemon.policy import Refusal, resolve_target

#: Buzz's managed-agent record (parameterized replaceable).
KIND_MANAGED_AGENT = 30177
#: NIP-29 put-user (add a member to a group), signed by the owner.
KIND_PUT_USER = 9000
#: NIP-09 deletion request.
KIND_DELETION = 5
#: The spec's default for an absent respondTo.
DEFAULT_RESPOND_TO = "owner-only"

#: wire member of agents.create/update -> member of the 30177 content. The order is the
#: order Buzz writes them in.
RECORD_MEMBERS: dict[str, str] = {
    "displayName": "name",
    "systemPrompt": "system_prompt",
    "model": "model",
    "provider": "provider",
    "runtime": "runtime",
    "respondTo": "respond_to",
}

#: wire member -> attribute of the contract's argument value.
ARG_ATTRIBUTES: dict[str, str] = {
    "displayName": "display_name",
    "systemPrompt": "system_prompt",
    "model": "model",
    "provider": "provider",
    "runtime": "runtime",
    "respondTo": "respond_to",
}


def record_content(fields: Mapping[str, Any]) -> str:
    """The 30177 content for the given record members (absent ones omitted)."""
    content: dict[str, Any] = {}
    for member in ("name", "system_prompt", "model", "provider", "runtime"):
        if fields.get(member) is not None:
            content[member] = fields[member]
    content["parallelism"] = 1
    content["respond_to"] = fields.get("respond_to") or DEFAULT_RESPOND_TO
    return json.dumps(content, ensure_ascii=False, separators=(",", ":"))


def is_record_of(event: Mapping[str, Any], owner: str, agent: str) -> bool:
    """Exactly `agent`'s managed record by `owner`: kind 30177, author, and `d` tag."""
    return (
        event.get("kind") == KIND_MANAGED_AGENT
        and event.get("pubkey") == owner
        and tag_value(event, "d") == agent
    )


def coordinate(owner: str, agent: str) -> str:
    """The NIP-01 address of an agent's managed record."""
    return f"{KIND_MANAGED_AGENT}:{owner}:{agent}"


def owned_target(ctx: Context, target: AgentTarget) -> AgentRecord:
    """The live agent the requester owns that `target` names; refuses otherwise."""
    found = resolve_target(ctx.principal, target, ctx.custody)
    if isinstance(found, Refusal):
        raise OperationRefused(found.code, found.message)
    return found


def refuse_unknown_requester() -> OperationRefused:
    return OperationRefused(ErrorCode.UNAUTHORIZED, "the requesting agent is not held by this host")
