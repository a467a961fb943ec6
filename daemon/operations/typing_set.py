"""typing.set: "this agent is typing in this channel", a NIP-BA live signal.

On the relay (NIP-BA "Live signals"): kind 20002 signed by the requester, tags
`["h", channel]` (plus the owner's NIP-OA tag custody adds), empty content. There is no
stop action: the indicator lapses under the reader's policy. Kind 20002 is ephemeral, so
success means the relay's `OK true`; a replay sends nothing, a renewal is a new request.
The channel must be one of the credential's (policy's channel check, as for a post).
"""

from __future__ import annotations

from buzzwire import kinds
from buzzwire.contract import PublishOutcome, TypingSetArgs
from daemon.operations._base import Context, Plan
from daemon.operations._events import sign

#: Buzz's typing-indicator kind (NIP-BA typing.set).
KIND_TYPING = kinds.TYPING


async def prepare(ctx: Context, args: TypingSetArgs) -> Plan:
    event = await sign(ctx, ctx.principal.agent, KIND_TYPING, [("h", args.channel_id)], "")
    return Plan(
        events=(event,),
        outcome=PublishOutcome(event_id=event.id, kind=event.kind, created_at=event.created_at),
    )
