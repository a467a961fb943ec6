"""message.reply: a reply in a channel thread, with NIP-10 markers as Buzz writes them.

Steps (buzz-on-the-relay.md, "Replies"):
1. Fetch the parent by id. Missing, unverifiable, or in another channel → `action_failed`.
2. Its root is its `e` tag marked `root`, else its `e` tag marked `reply`, else the parent.
3. root == parent: one tag `["e", parent, "", "reply"]`; otherwise `["e", root, "", "root"]`
   then `["e", parent, "", "reply"]` — between the `h` tag and the `p` tags.

Rule (issue 13, relay data is checked before it is signed over): every event id copied
into a tag must be an event id — lowercase 64 hex. The parent's id is (its id and signature
were verified); the root comes from the parent's tags, which whoever wrote the parent
chose, so a root that is not 64 hex is `action_failed` and nothing is signed.
"""

from __future__ import annotations

from buzzwire.contract import ErrorCode, MessageReplyArgs, PublishOutcome
from buzzwire.nostr import SignedEvent, is_hex64
from daemon.operations._base import Context, OperationRefused, Plan
from daemon.operations._events import fetch_in_channel, mention_tags, sign
from daemon.operations.message_post import KIND_STREAM_MESSAGE


def thread_root(parent: SignedEvent) -> str:
    """Buzz's rule for the root of the thread a parent belongs to."""
    for marker in ("root", "reply"):
        for tag in parent.tags:
            if len(tag) >= 4 and tag[0] == "e" and tag[3] == marker:
                return tag[1]
    return parent.id


def thread_tags(parent: SignedEvent) -> list[tuple[str, ...]]:
    """The reply's `e` tags; refuses (action_failed) an id that is not 64 lowercase hex."""
    parent_id = parent.id
    root = thread_root(parent)
    for copied in (parent_id, root):
        if not is_hex64(copied):
            raise OperationRefused(
                ErrorCode.ACTION_FAILED,
                "the message replied to names a thread root that is not an event id",
                detail=f"parent {parent_id[:64]!r} names root {copied[:80]!r}",
            )
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
            event_id=event.id, kind=event.kind, created_at=event.created_at
        ),
    )
