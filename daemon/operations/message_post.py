"""message.post: a top-level channel message.

On the relay (buzz-on-the-relay.md, "The nine operations"): kind 9 signed by the
requester, content exactly as written, tags `["h", channel]` then one `["p", pk]` per
mention. The outcome is known before the relay answers.
"""

from __future__ import annotations

from buzzwire import kinds
from buzzwire.contract import MessagePostArgs, PublishOutcome
from daemon.operations._base import Context, Plan
from daemon.operations._events import mention_tags, sign

#: Buzz's stream message kind (NIP-29 channel chat).
KIND_STREAM_MESSAGE = kinds.STREAM_MESSAGE


async def prepare(ctx: Context, args: MessagePostArgs) -> Plan:
    tags = [("h", args.channel_id), *mention_tags(args.mentions)]
    event = await sign(ctx, ctx.principal.agent, KIND_STREAM_MESSAGE, tags, args.content)
    return Plan(
        events=(event,),
        outcome=PublishOutcome(
            event_id=event.id, kind=event.kind, created_at=event.created_at
        ),
    )
