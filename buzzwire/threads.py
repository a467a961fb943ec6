"""Which channel and which thread a Nostr event is in, read from its signed tags alone.

Rules:
- One rule each, kept here so the three that judge an event judge it alike: the broker's
  channel.read (what a page may deliver), its message.reply (what a reply builds on) and
  the echo check of `buzzwire.contract` (what the agent-side client, and the host's tests
  on real answers, accept as a page of that channel or thread). NIP-BA: "All returned
  messages MUST satisfy the requested channel/thread/mention filters. Ancestry and
  mentions come from signed tags".
- Channel (`in_channel`): the set of the event's `h` tag values is exactly {channel}.
- Thread (`declared_thread`, `in_thread`): NIP-10 marked `e` tags, as Buzz writes them.
  The root is the value of the `e` tag marked `root`, else of the one marked `reply`,
  else the event is a root. `mention` cites without threading. A positional (unmarked)
  tag, or two different values under the marker that decides, make the thread
  unreadable, and an unreadable event is in no thread.
- Tags are compared as written: values are not parsed or case-folded here. A caller
  that compares spellings (the echo check) canonicalizes the values first.

Pure: no I/O, no clock, no logging; stdlib only. It is not part of `buzzwire.nostr`, which
the custodian imports and whose size is counted (tests/custodian/test_size.py): the
custodian never reads a thread.

WARNING: message.reply writes the tags `declared_thread` reads (its `thread_tags`, step 4
of daemon/operations/message_reply.py), and channel.read asks the relay for `#h` and `#e`,
which must return a superset of what these rules accept.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["CHANNEL_TAG", "THREAD_TAG", "Ancestry", "declared_thread", "in_channel", "in_thread"]

#: Buzz's channel tag (buzz-on-the-relay.md "Channels"): the channel an event is filed in.
CHANNEL_TAG = "h"
#: NIP-10's event tag: a thread's root, the event replied to, or a mention.
THREAD_TAG = "e"
#: NIP-10 markers an `e` tag may carry here; `mention` cites without threading.
_E_MARKERS = frozenset({"root", "reply", "mention"})
#: The markers that name the thread, in the order they are read: `root`, else `reply`
#: (Buzz's direct reply to a root carries only a `reply`-marked tag).
_THREAD_MARKERS = ("root", "reply")


def in_channel(tags: Iterable[Sequence[str]], channel_id: str) -> bool:
    """The one rule for "this event is in that channel": its `h` values are exactly
    {channel_id}.

    Why the whole set and not the first `h` tag: an event carrying two channels' `h` tags
    would otherwise be in whichever channel its author listed first, so a credential of
    one channel could reply or react to an event also filed in another, depending on the
    order of its tags alone, while a read of either channel never returns it.
    """
    return {tag[1] for tag in tags if len(tag) >= 2 and tag[0] == CHANNEL_TAG} == {channel_id}


@dataclass(frozen=True, slots=True, kw_only=True)
class Ancestry:
    """The thread an event's signed `e` tags declare (`declared_thread`).

    Attributes:
        root: the root they name; None when they name none (the event is a root) or when
            they cannot be read.
        unreadable: why they cannot be read, else None. "positional": an `e` tag without
            a NIP-10 marker (or with one not in `_E_MARKERS`): NIP-10's deprecated form,
            where `["e", R]` may mean "reply to R", so taking the event for a root, or R
            for its root, would each be a guess. "several": two different values under
            the marker that decides: picking one would be a silent choice.
        detail: for the operator log only (the tag or the count at fault); relay text,
            never shown to an agent.
    """

    root: str | None = None
    unreadable: Literal["positional", "several"] | None = None
    detail: str = ""

    def __post_init__(self) -> None:
        if self.root is not None and self.unreadable is not None:
            raise ValueError("an unreadable ancestry names no root")


def declared_thread(tags: Iterable[Sequence[str]]) -> Ancestry:
    """The one rule for "which thread is this event in", read from its signed tags alone
    (NIP-10 marked `e` tags, as Buzz writes them): the value of its `e` tag marked `root`,
    else of its `e` tag marked `reply`, else none (it is a root). `mention` tags are
    ignored. A positional tag or two different deciding values make it unreadable
    (`Ancestry`).

    message.reply refuses to build on an unreadable parent; channel.read and the echo
    check (`in_thread`) leave such an event out of every thread. Neither raises here: each
    caller decides what an unreadable thread means for it.
    """
    named: dict[str, set[str]] = {marker: set() for marker in _THREAD_MARKERS}
    for tag in tags:
        if not tag or tag[0] != THREAD_TAG:  # a relay's event may hold an empty tag
            continue
        marker = tag[3] if len(tag) >= 4 else ""
        if marker not in _E_MARKERS:
            return Ancestry(unreadable="positional", detail=f"tag {list(tag)[:4]!r:.200}")
        if marker in named:
            named[marker].add(tag[1])
    for marker in _THREAD_MARKERS:
        values = named[marker]
        if len(values) > 1:
            return Ancestry(unreadable="several", detail=f"{len(values)} {marker} values")
        if values:
            return Ancestry(root=next(iter(values)))
    return Ancestry()


def in_thread(event_id: str, tags: Iterable[Sequence[str]], root_event_id: str) -> bool:
    """The event is in the thread of `root_event_id`: it is that event, or the root its
    signed tags declare (`declared_thread`) is it. An event whose thread is unreadable is
    in no thread, and citing the root (a `mention`, or a reply elsewhere naming it) is
    not being in its thread.

    A root that is itself a reply: the event is its own thread's only certain member.
    Its replies written as Buzz writes them name the outer root (message.reply's step 4),
    so they are in that thread, not this one; only an event declaring this one its root
    is added (another client's claim, in its own signed tags).
    """
    return event_id == root_event_id or declared_thread(tags).root == root_event_id
