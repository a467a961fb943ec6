"""message.reply: a reply in a channel thread, with NIP-10 markers as Buzz writes them.

Steps (buzz-on-the-relay.md, "Replies"):
1. Fetch the parent by id. Missing, unverifiable, or in another channel → `action_failed`.
2. Its root is its `e` tag marked `root`, else its `e` tag marked `reply`, else the parent.
3. root == parent: one tag `["e", parent, "", "reply"]`; otherwise `["e", root, "", "root"]`
   then `["e", parent, "", "reply"]` — between the `h` tag and the `p` tags.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from buzzwire.contract import MessageReplyArgs, PublishOutcome
from daemon.operations._base import Context, Plan
from daemon.operations._events import fetch_in_channel, mention_tags, sign
from daemon.operations.message_post import KIND_STREAM_MESSAGE


def thread_root(parent: Mapping[str, Any]) -> str:
    """Buzz's rule for the root of the thread a parent belongs to."""
    for marker in ("root", "reply"):
        for tag in parent.get("tags", ()):
            if len(tag) >= 4 and tag[0] == "e" and tag[3] == marker:
                return str(tag[1])
    return str(parent["id"])


def thread_tags(parent: Mapping[str, Any]) -> list[tuple[str, ...]]:
    parent_id = str(parent["id"])
    root = thread_root(parent)
    if root == parent_id:
        return [("e", parent_id, "", "reply")]
    return [("e", root, "", "root"), ("e", parent_id, "", "reply")]


async def prepare(ctx: Context, args: MessageReplyArgs) -> Plan:
    parent = await fetch_in_channel(ctx, args.reply_to_event_id, args.channel_id,
                                    what="the message replied to")
    tags = [("h", args.channel_id), *thread_tags(parent), *mention_tags(args.mentions)]
    event = await sign(ctx, ctx.principal.agent, KIND_STREAM_MESSAGE, tags, args.content)
    return Plan(
        events=(event,),
        outcome=PublishOutcome(
            event_id=event["id"], kind=event["kind"], created_at=event["created_at"]
        ),
    )
