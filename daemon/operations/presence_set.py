"""presence.set: the agent's presence, a NIP-BA live signal.

On the relay (NIP-BA "Live signals"): kind 20001 signed by the requester, content exactly
the status (`online`, `away`, `offline`; offline clears presence), no tags of our own (the
owner's NIP-OA tag is added by custody, as on every event an owned agent signs). Kind
20001 is ephemeral (NIP-01: 20000-29999): a relay forwards it to open subscriptions and
stores nothing, so success means the relay's `OK true` and no more. Each call is a new
signal; a replay answers the stored verdict and sends nothing (the pipeline's ledger).
"""

from __future__ import annotations

from buzzwire import kinds
from buzzwire.contract import PresenceSetArgs, PublishOutcome
from daemon.operations._base import Context, Plan
from daemon.operations._events import sign

#: Buzz's presence kind (NIP-BA presence.set).
KIND_PRESENCE = kinds.PRESENCE


async def prepare(ctx: Context, args: PresenceSetArgs) -> Plan:
    event = await sign(ctx, ctx.principal.agent, KIND_PRESENCE, [], args.status)
    return Plan(
        events=(event,),
        outcome=PublishOutcome(event_id=event.id, kind=event.kind, created_at=event.created_at),
    )
