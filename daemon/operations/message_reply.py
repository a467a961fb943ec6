"""message.reply: a reply in a channel thread, with NIP-10 markers as Buzz writes them.

Steps (buzz-on-the-relay.md, "Replies"; NIP-BA "Channel and messages"):
1. Fetch the parent by id. Missing, unverifiable, in another channel, or not a channel
   message (a kind channel.read does not return) → `action_failed`.
2. Read the root its tags name (`declared_root`, on the one rule
   `buzzwire.threads.declared_thread` that channel.read's thread check uses
   too): its `e` tag marked `root`, else its `e` tag marked `reply` (Buzz's direct reply
   to a root carries only that one), else none: the parent is the root.
3. A root other than the parent is fetched in the channel too (a channel message as
   well), and must be a root itself.
4. root == parent: one tag `["e", parent, "", "reply"]`; otherwise `["e", root, "", "root"]`
   then `["e", parent, "", "reply"]` — between the `h` tag and the `p` tags.

Rules (NIP-BA: "it MUST NOT silently treat a nested parent as the root. Missing,
inaccessible, or inconsistent ancestry MUST fail before publication"; issue 13: relay data
is checked before it is signed over). Each refusal is `action_failed`, nothing signed:
- An `e` tag without a NIP-10 marker (or with one that is not `root`, `reply`, `mention`)
  is NIP-10's deprecated positional form, where `["e", R]` may mean "reply to R": reading
  such a parent as a root would publish a nested reply as a top-level one.
- Two different `root` values (or, with no root, two different `reply` values) leave the
  thread ambiguous: picking one would be a silent choice.
- The root is copied into the signed reply, so it must be an event id (lowercase 64 hex)
  of an event in this channel that is itself a root (no root/reply-marked `e` tags): a
  root that does not exist, lives elsewhere or answers something else is not the thread.
"""

from __future__ import annotations

from collections.abc import Mapping

from buzzwire.contract import ErrorCode, MessageReplyArgs, PublishOutcome
from buzzwire.nostr import SignedEvent, is_hex64
from buzzwire.threads import declared_thread
from daemon.operations._base import Context, OperationRefused, Plan
from daemon.operations._events import fetch_in_channel, mention_tags, sign
from daemon.operations.message_post import KIND_STREAM_MESSAGE

#: Why an event's ancestry is refused -> what the agent is told; `{what}` is our fixed
#: name for the event ("the message replied to"), never relay text. The first two are
#: `Ancestry.unreadable`'s reasons.
_REFUSALS: Mapping[str, str] = {
    "positional": "{what} has e tags without a NIP-10 marker, so its thread cannot be read",
    "several": "{what} names more than one thread root",
    "not_an_id": "{what} names a thread root that is not an event id",
    "not_a_root": "{what} names a thread root that is itself a reply",
}


def _refuse(reason: str, what: str, detail: str) -> OperationRefused:
    return OperationRefused(ErrorCode.ACTION_FAILED, _REFUSALS[reason].format(what=what),
                            detail=detail)


def declared_root(event: SignedEvent, what: str) -> str | None:
    """The thread root `event`'s own tags name, or None when they name none (a root).

    Raises:
      OperationRefused(action_failed): a positional `e` tag, or two different values under
        the marker that decides (module doc).
    """
    ancestry = declared_thread(event.tags)
    if ancestry.unreadable is not None:
        raise _refuse(ancestry.unreadable, what, f"event {event.id}: {ancestry.detail}")
    return ancestry.root


def thread_tags(parent_id: str, root: str) -> list[tuple[str, ...]]:
    """The reply's `e` tags, exactly as Buzz writes them (module doc, step 4)."""
    if root == parent_id:
        return [("e", parent_id, "", "reply")]
    return [("e", root, "", "root"), ("e", parent_id, "", "reply")]


async def thread_root(ctx: Context, parent: SignedEvent, channel_id: str) -> str:
    """The id of the root of the thread `parent` is in, checked (module doc, steps 2-3)."""
    what = "the message replied to"
    root = declared_root(parent, what)
    if root is None:
        return parent.id
    if not is_hex64(root):
        raise _refuse("not_an_id", what, f"parent {parent.id} names root {root[:80]!r}")
    fetched = await fetch_in_channel(ctx, root, channel_id, what="the thread root")
    if declared_root(fetched, "the thread root") is not None:
        raise _refuse("not_a_root", what, f"parent {parent.id} names root {root}")
    return root


async def prepare(ctx: Context, args: MessageReplyArgs) -> Plan:
    parent = await fetch_in_channel(ctx, args.reply_to_event_id, args.channel_id,
                                    what="the message replied to")
    root = await thread_root(ctx, parent, args.channel_id)
    tags = [("h", args.channel_id), *thread_tags(parent.id, root), *mention_tags(args.mentions)]
    event = await sign(ctx, ctx.principal.agent, KIND_STREAM_MESSAGE, tags, args.content)
    return Plan(
        events=(event,),
        outcome=PublishOutcome(
            event_id=event.id, kind=event.kind, created_at=event.created_at
        ),
    )
