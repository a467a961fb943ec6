"""reaction.add: a NIP-25 reaction, the one best-effort operation of version 1.

On the relay: kind 7, content = the reaction, `["e", target]`. Buzz's own client adds
neither `h` nor `p`; we add `["h", channel]` (the relay spec calls it the host's choice and
harmless) so that a relay fanning out by channel sees the reaction where the message is.

The target is fetched first, like a reply's parent: a target that cannot be found, that
is in another channel than the request's, or that is not a channel message (a kind
channel.read does not return: NIP-BA, "Reaction targets likewise MUST belong to the
channel") is `action_failed`. Without that check a
credential bound to channel A could react to an event of channel B, acting outside its
channels and labelling the reaction `["h", A]` for every Buzz reader. A host that switches
reactions off answers `unsupported` from policy, before this runs.
"""

from __future__ import annotations

from buzzwire import kinds
from buzzwire.contract import PublishOutcome, ReactionAddArgs
from daemon.operations._base import Context, Plan
from daemon.operations._events import fetch_in_channel, sign

#: NIP-25 reaction.
KIND_REACTION = kinds.REACTION


async def prepare(ctx: Context, args: ReactionAddArgs) -> Plan:
    await fetch_in_channel(ctx, args.target_event_id, args.channel_id, what="the reaction's target")
    tags = [("e", args.target_event_id), ("h", args.channel_id)]
    event = await sign(ctx, ctx.principal.agent, KIND_REACTION, tags, args.reaction)
    return Plan(
        events=(event,),
        outcome=PublishOutcome(
            event_id=event.id, kind=event.kind, created_at=event.created_at
        ),
    )
