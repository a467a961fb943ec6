"""The page echoes of channel.read (I5): every event of a page must be, by its signed tags,
in the channel and the thread the request asked for, and mention the requester on a
mentions-only read; `echo_mismatch` reads them from the wire form of the outcome, so these
tests pin that walk. Channel and thread are `buzzwire.threads`' rules, the ones the host's
channel.read delivers by: each table below is judged by the echo check and by the rule
itself, and the two must agree."""

from __future__ import annotations

import pytest

from buzzwire.contract import (
    ACTIONS, ChannelReadArgs, Echo, Event, Identity, ReadOutcome, echo_mismatch,
)
from buzzwire.contract._echoes import Membership, _event_holds
from buzzwire.threads import in_channel, in_thread

from .vectors import CHANNEL, EVENT_ID

OTHER_CHANNEL = "6df7dfa8-e919-43df-8efd-f1dcb8af7071"
ME = "ab" * 32
ECHOES = ACTIONS["channel.read"].echoes


def event(*tags: tuple[str, ...], event_id: str = "cd" * 32) -> Event:
    return Event(id=event_id, pubkey="ef" * 32, created_at=1, kind=9, tags=tags,
                 content="hi", sig="01" * 64)


def mismatch(args: ChannelReadArgs, *events: Event) -> str | None:
    return echo_mismatch(ECHOES, args, ReadOutcome(messages=events), ME)


def e(event_id: str, marker: str) -> tuple[str, ...]:
    """An `e` tag as Buzz writes it: NIP-10 marked, no relay hint."""
    return ("e", event_id, "", marker)


#: the fixed sentences of a broken page (`_MEMBERSHIPS`)
NOT_IN_CHANNEL = "an event of the page is not in exactly the channel of the request's channelId"
NOT_IN_THREAD = "an event of the page is not in the thread of the request's rootEventId"
NOT_MENTIONED = "an event of the page has no p tag echoing the request's @requester"

H = ("h", CHANNEL)
R = EVENT_ID  # the thread read's root
S = "5e" * 32  # another thread's root
DIRECT = "d1" * 32  # Buzz's direct reply to R

#: an event's tags -> in CHANNEL (its `h` values are exactly {CHANNEL}: `in_channel`)
CHANNEL_CASES: dict[str, tuple[tuple[tuple[str, ...], ...], bool]] = {
    "one h tag": ((H,), True),
    "the same channel twice": ((H, H), True),
    "another channel": ((("h", OTHER_CHANNEL),), False),
    "two h tags, the other channel second": ((H, ("h", OTHER_CHANNEL)), False),
    "two h tags, the other channel first": ((("h", OTHER_CHANNEL), H), False),
    "no h tag": ((), False),
    "an h tag with no value": ((("h",),), False),  # a tag with no value names nothing
    "the channel under another tag": ((("d", CHANNEL),), False),
}


@pytest.mark.parametrize(("tags", "member"), CHANNEL_CASES.values(), ids=CHANNEL_CASES)
def test_an_event_is_in_the_channel_when_its_h_values_are_exactly_it(
        tags: tuple[tuple[str, ...], ...], member: bool) -> None:
    assert in_channel(tags, CHANNEL) is member
    args = ChannelReadArgs(channel_id=CHANNEL)
    assert mismatch(args, event(*tags)) == (None if member else NOT_IN_CHANNEL)
    # One event out of the channel breaks a page of events in it.
    assert mismatch(args, event(H), event(*tags), event(H)) == (None if member else NOT_IN_CHANNEL)


#: a page event -> in R's thread (it is R, or its signed e tags declare R its root:
#: `in_thread`); the events a relay answers `#e` = [R] with (tests/read's `Threads`)
THREAD_CASES: dict[str, tuple[Event, bool]] = {
    "R itself": (event(H, event_id=R), True),
    "a direct reply (reply-marked R only)": (event(H, e(R, "reply")), True),
    "a nested reply (root R)": (event(H, e(R, "root"), e(DIRECT, "reply")), True),
    "a reply mentioning R too": (event(H, e(R, "reply"), e(R, "mention")), True),
    "a top-level message mentioning R": (event(H, e(R, "mention")), False),
    "a reply in another thread citing R": (event(H, e(S, "root"), e(S, "reply"), e(R, "mention")),
                                           False),
    "a positional tag": (event(H, ("e", R)), False),
    "a positional tag with a relay hint": (event(H, ("e", R, "wss://relay.example")), False),
    "an unknown marker": (event(H, e(R, "quote")), False),
    "two roots": (event(H, e(R, "root"), e(S, "root")), False),
    "root S, reply R": (event(H, e(S, "root"), e(R, "reply")), False),
    "a root of its own": (event(H), False),
}


@pytest.mark.parametrize(("ev", "member"), THREAD_CASES.values(), ids=THREAD_CASES)
def test_an_event_is_in_the_thread_its_signed_tags_declare_not_one_it_cites(
        ev: Event, member: bool) -> None:
    assert in_thread(ev.id, ev.tags, R) is member
    args = ChannelReadArgs(channel_id=CHANNEL, root_event_id=R)
    assert mismatch(args, ev) == (None if member else NOT_IN_THREAD)
    # One event off the thread breaks a page of the thread.
    page = [case for case, holds in THREAD_CASES.values() if holds]
    assert mismatch(args, *page, ev) == (None if member else NOT_IN_THREAD)


def test_a_read_of_a_reply_is_not_its_childrens_thread() -> None:
    # `DIRECT` answers R; a reply to it declares R its root, so it is R's thread
    # (channel_read.py module doc, "A thread is ancestry, not citation").
    args = ChannelReadArgs(channel_id=CHANNEL, root_event_id=DIRECT)
    assert mismatch(args, event(H, e(R, "reply"), event_id=DIRECT)) is None
    assert mismatch(args, event(H, e(R, "root"), e(DIRECT, "reply"))) == NOT_IN_THREAD


def test_page_events_echo_the_channel_and_root_in_any_spelling() -> None:
    args = ChannelReadArgs(channel_id=CHANNEL)
    assert mismatch(args, event(("h", CHANNEL.upper().replace("-", "")))) is None
    assert mismatch(args) is None  # an empty page echoes nothing and breaks nothing
    # The rule is the host's; only the spelling of an identity is forgiven.
    thread = ChannelReadArgs(channel_id=CHANNEL, root_event_id=R)
    assert mismatch(thread, event(H, e(R.upper(), "root"), e(DIRECT, "reply"))) is None
    assert mismatch(thread, event(H, e(R.upper(), "mention"))) == NOT_IN_THREAD
    assert mismatch(thread, event(H, ("e", R.upper()))) == NOT_IN_THREAD


#: what a page event may be on the wire, which the typed outcome cannot hold: not an object,
#: an id that is no string, tags that are not lists of strings. Each breaks every echo.
MALFORMED: dict[str, object] = {
    "not an object": [["h", CHANNEL]],
    "no id": {"tags": [["h", CHANNEL]]},
    "an id that is a number": {"id": 1, "tags": [["h", CHANNEL]]},
    "no tags": {"id": R},
    "tags that are an object": {"id": R, "tags": {"h": CHANNEL}},
    "a tag that is a string": {"id": R, "tags": [["h", CHANNEL], "h"]},
    "a tag holding a number": {"id": R, "tags": [["h", CHANNEL], ["e", R, "", "root", 1]]},
}


@pytest.mark.parametrize("wire", MALFORMED.values(), ids=MALFORMED)
def test_a_malformed_wire_event_breaks_every_echo(wire: object) -> None:
    for echo in ECHOES:
        wanted = CHANNEL if echo.identity is Identity.CHANNEL else R
        assert _event_holds(echo, echo.event_tag or "", wire, wanted) is False


def test_a_membership_is_only_valid_on_the_tag_and_identity_it_reads() -> None:
    with pytest.raises(ValueError):
        Echo(outcome="messages[].e", source="channelId", identity=Identity.CHANNEL,
             membership=Membership.CHANNEL)
    with pytest.raises(ValueError):
        Echo(outcome="messages[].e", source="rootEventId", identity=Identity.CHANNEL,
             membership=Membership.THREAD)
    with pytest.raises(ValueError):
        Echo(outcome="channelId", source="channelId", identity=Identity.CHANNEL,
             membership=Membership.CHANNEL)


def test_mentions_only_needs_a_p_tag_naming_the_requester() -> None:
    args = ChannelReadArgs(channel_id=CHANNEL, mentions_only=True)
    assert mismatch(args, event(("h", CHANNEL), ("p", ME))) is None
    assert mismatch(args, event(("h", CHANNEL), ("p", "ef" * 32))) is not None
    # Without mentionsOnly the p tag is not asked for, so none is needed.
    assert mismatch(ChannelReadArgs(channel_id=CHANNEL), event(("h", CHANNEL))) is None


@pytest.mark.parametrize("tag", [("e", ME), ("q", ME), ("auth", ME, "", "01" * 64), ("P", ME)],
                         ids=["e", "q", "auth", "capital-P"])
def test_the_requester_under_another_tag_is_no_mention(tag: tuple[str, ...]) -> None:
    # Only a `p` tag mentions: the requester's key as an `e`/`q` value, or as the NIP-OA
    # `auth` tag an owned agent's event carries (naming its owner), is no mention of it.
    args = ChannelReadArgs(channel_id=CHANNEL, mentions_only=True)
    assert mismatch(args, event(H, tag)) == NOT_MENTIONED
    assert mismatch(args, event(H, tag, ("p", ME.upper()))) is None
