"""agents.delete: remove a managed agent the requester owns.

On the relay: an owner-signed kind 5 with `["a", "30177:<owner>:<agent>"]` and
`["k", "30177"]`. Once the relay accepted it, the agent's credentials stop working and the
key is destroyed in custody (the public record stays as a tombstone) — the `commit`
housekeeping, which the identical retry runs again if a crash or a fault came between the
two (a fault answers `indeterminate`, daemon/pipeline/publisher.py).
"""

from __future__ import annotations

from buzzwire.contract import AgentsDeleteArgs, AgentsDeleteOutcome
from daemon.operations._base import Context, Plan
from daemon.operations._events import sign
from daemon.operations._managed import (
    KIND_DELETION,
    KIND_MANAGED_AGENT,
    coordinate,
    outcome_name,
    owned_target,
)
from daemon.pipeline.pending import DestroyAgent


async def prepare(ctx: Context, args: AgentsDeleteArgs) -> Plan:
    owner = ctx.principal.agent
    agent = owned_target(ctx)
    event = await sign(
        ctx,
        owner,
        KIND_DELETION,
        [("a", coordinate(owner, agent.pubkey)), ("k", str(KIND_MANAGED_AGENT))],
        "",
    )
    return Plan(
        events=(event,),
        outcome=AgentsDeleteOutcome(agent_pubkey=agent.pubkey,
                                    display_name=outcome_name(agent.name, agent.pubkey)),
        commit=(DestroyAgent(pubkey=agent.pubkey),),
    )
